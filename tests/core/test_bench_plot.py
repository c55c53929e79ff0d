"""`attn-backends bench --plot`: x ticks are the lengths run, titles say what was timed."""

from __future__ import annotations

from typing import Any

from attn_backends_cli import bench as _bench
from attn_backends_cli import main as _cli

SEQS = (384, 1000, 3072)


def _rows() -> list[_bench.BenchRow]:
    return [_bench.BenchRow(name, seq, kind, 0.01 * seq * (2 if kind == "fwd+bwd" else 1))
            for name in ("reference", "xla_native") for seq in SEQS
            for kind in ("fwd", "fwd+bwd")]


def test_x_axis_ticks_are_the_lengths_run_and_titles_name_the_setup() -> None:
    import matplotlib.pyplot as plt

    setup = _bench.setup_label(heads=8, head_dim=64, dtype="bfloat16", causal=True,
                               platform="cpu", device_kind="cpu")
    fig = _bench.figure(_rows(), setup)
    try:
        for ax, kind in zip(fig.axes, ("fwd", "fwd+bwd"), strict=True):
            fig.canvas.draw()
            labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
            assert labels == [str(s) for s in SEQS], labels
            assert list(ax.get_xticks()) == list(SEQS)
            assert not [t for t in ax.xaxis.get_minorticklabels() if t.get_text()]
            title = ax.get_title()
            assert title.startswith(kind + "\n"), title
            for part in ("[1, S, 8, 64]", "bfloat16", "causal", "cpu"):
                assert part in title, (part, title)
    finally:
        plt.close(fig)


def test_cli_passes_shape_dtype_and_device_to_the_plot(monkeypatch: Any, tmp_path: Any) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(_bench, "run", lambda *a, **k: _rows())
    monkeypatch.setattr(_bench, "plot", lambda rows, path, setup="": seen.update(setup=setup))
    argv = ["bench", "--device", "cpu", "--seq", "384,1000,3072", "--heads", "4",
            "--head-dim", "32", "--dtype", "float16", "--no-causal", "--json",
            "--plot", str(tmp_path / "b.png")]
    assert _cli.main(argv) == 0
    assert seen["setup"].startswith("q/k/v [1, S, 4, 32] float16 no mask, cpu"), seen
