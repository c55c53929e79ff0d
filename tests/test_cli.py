"""The attn-backends command: list and explain, for people and for machines."""

from __future__ import annotations

import json

import pytest
from attn_backends_cli.main import main


@pytest.fixture(autouse=True)
def only_reference(monkeypatch):
    import attn_backends

    monkeypatch.setenv("ATTN_BACKENDS_ONLY", "reference")
    monkeypatch.setattr(attn_backends.choose.registry, "registry", attn_backends.Registry())


def test_list_table_and_json(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header == ["backend", "distribution", "version", "platforms", "dtypes", "head", "dims",
                      "features", "certified", "probes"]
    assert "reference  attn-backend-reference" in out
    assert main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["backend"] for b in data["backends"]] == ["reference"]
    assert data["backends"][0]["capabilities"]["causal"] is True
    assert data["problems"] == []


def test_the_librarys_warnings_are_one_line_each_others_keep_pythons_way(capsys, monkeypatch):
    import warnings

    from attn_backends import PluginWarning
    from attn_backends_cli import main as cli_main

    def warn_then_list(args):
        warnings.warn("backend 'x' supports jax <0.1: it will not be selected", PluginWarning,
                      stacklevel=1)
        warnings.warn("not ours", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(cli_main, "cmd_list", warn_then_list)
    before = warnings.showwarning
    with pytest.warns(UserWarning, match="not ours") as seen:  # Python's machinery, untouched
        assert main(["list"]) == 0
    assert [str(w.message) for w in seen] == ["not ours"]
    assert capsys.readouterr().err.splitlines() == [
        "attn-backends: PluginWarning: backend 'x' supports jax <0.1: it will not be selected"]
    assert warnings.showwarning is before  # restored on the way out


def test_explain_prints_every_verdict(capsys):
    argv = ["explain", "--device", "cpu", "--q", "2,128,8,64", "--kv", "2,256,2,64",
            "--dtype", "bfloat16", "--causal", "--window", "32,", "--segment-ids", "--kv-lengths",
            "--softcap", "30", "--return-lse"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "q[2,128,8,64] kv[2,256,2,64/64] bfloat16 gqa causal window=(32, None) "
        "segment_ids lengths softcap return_lse"
    ) in out
    assert "reference" in out and "CHOSEN" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == "reference" and data["call"]["window"] == [32, None]


def test_explain_says_a_key_mask_is_rewritten_for_a_tpu_kernel(capsys, monkeypatch):
    import attn_backends

    monkeypatch.delenv("ATTN_BACKENDS_PALLAS_INTERPRET", raising=False)
    monkeypatch.setattr(attn_backends.choose.registry, "registry",
                        attn_backends.Registry(only=["flash_pallas", "reference"]))
    argv = ["explain", "--device", "tpu", "--q", "2,1,8,128", "--kv", "2,512,2,128",
            "--dtype", "bfloat16", "--key-mask"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("flash_pallas"))
    assert "CHOSEN" in lines[at] and lines[at + 1].strip() == "= key mask rewritten as segment ids"
    assert not any("key mask" in line for line in lines[at + 2:])  # reference gets the mask


def test_explain_bad_input_is_a_message_not_a_traceback(capsys):
    assert main(["explain", "--q", "1,8,3,64", "--kv", "1,8,2,64"]) == 2
    err = capsys.readouterr().err
    assert "heads: expected q heads Hq=3 to be a multiple of kv heads Hkv=2" in err
    with pytest.raises(SystemExit):
        main(["explain", "--q", "1,8,64", "--kv", "1,8,2,64"])
    assert "--q: expected 4 comma-separated integers" in capsys.readouterr().err


def test_explain_unknown_backend(capsys):
    assert main(["explain", "--q", "1,8,2,64", "--kv", "1,8,2,64", "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert "backend='nope': no such backend is registered (installed: reference)" in err


def test_explain_for_an_absent_platform_is_manifest_only(capsys):
    assert main(["explain", "--device", "tpu", "--q", "1,8,2,64", "--kv", "1,8,2,64",
                 "--backend", "reference", "--dtype", "float16"]) == 0
    assert "(not present here: manifest only, unprobed)" in capsys.readouterr().out


def test_probe_fills_the_cache_and_list_shows_it(capsys, isolated_cache, monkeypatch):
    import attn_backends

    # Two backends, so one is probed against the reference.
    monkeypatch.setattr(attn_backends.choose.registry, "registry",
                        attn_backends.Registry(only=["reference", "xla_native"]))
    assert main(["probe", "--backends", "xla_native", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert {r["backend"] for r in results} == {"xla_native"}
    assert all(r["passed"] and r["source"] == "run" for r in results)
    assert len(list((isolated_cache / "probes").glob("*.json"))) == len(results)
    assert main(["list", "--json"]) == 0
    listed = {b["backend"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    assert listed["xla_native"]["probes"] == f"{len(results)} ok"
    assert listed["reference"]["probes"] == "-"


def test_doctor_reports_versions_platforms_backends_and_cache(capsys, isolated_cache):
    import jax

    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["jax"] == jax.__version__ and report["visible_platforms"] == {"cpu": "cpu"}
    assert report["cache_dir"] == str(isolated_cache)
    assert [b["backend"] for b in report["backends"]] == ["reference"]
    assert report["environment"]["ATTN_BACKENDS_ONLY"] == "reference"
    assert main(["doctor"]) == 0
    assert "load problems: none" in capsys.readouterr().out


def test_bench_times_each_backend_against_the_reference_and_plots(capsys, tmp_path,
                                                                  monkeypatch):
    import attn_backends

    monkeypatch.setattr(attn_backends.choose.registry, "registry",
                        attn_backends.Registry(only=["reference", "xla_native"]))
    png = tmp_path / "bench.png"
    argv = ["bench", "--seq", "64,128", "--heads", "2", "--reps", "1", "--json", "--plot", str(png)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert {(r["backend"], r["seq"], r["kind"]) for r in rows} == {
        (b, s, k)
        for b in ("reference", "xla_native")
        for s in (64, 128)
        for k in ("fwd", "fwd+bwd")
    }
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["vs_reference"] == 1.0 for r in rows if r["backend"] == "reference")
    # the progress bar (tqdm) shows on a terminal only: captured stderr holds none
    assert "16/16" not in captured.err and "\r" not in captured.err, captured.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "reference", "--quick", "--json", "c.json", "--", "-k", "causal", "-x"],
        ["check", "--quick", "--json", "c.json", "reference", "--", "-k", "causal", "-x"],
    ],
)
def test_check_takes_its_options_before_or_after_the_name(monkeypatch, argv):
    import attn_backends_contracts

    seen = []
    monkeypatch.setattr(attn_backends_contracts, "run_check",
                        lambda *args: seen.append(args) or 0)
    assert main(argv) == 0
    assert seen == [("reference", "c.json", ["--attn-quick", "-k", "causal", "-x"])]


def test_arguments_after_a_double_dash_are_only_for_check(capsys):
    with pytest.raises(SystemExit):
        main(["list", "--", "-x"])
    assert "only for check" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench", "--reps", "0"], "argument --reps: expected an integer >= 1, got '0'"),
        (["bench", "--seq", "0"],
         "argument --seq: expected comma-separated lengths >= 1 like 512,1024, got '0'"),
        # flash_pallas cannot serve cpu unless its interpreter is switched on.
        (["bench", "--backends", "flash_pallas", "--seq", "16", "--reps", "1"],
         "nothing was timed"),
    ],
)
def test_bench_refuses_what_it_cannot_time(capsys, monkeypatch, argv, message):
    import attn_backends

    monkeypatch.setenv("ATTN_BACKENDS_ONLY", "reference,flash_pallas")
    monkeypatch.delenv("ATTN_BACKENDS_PALLAS_INTERPRET", raising=False)
    monkeypatch.setattr(attn_backends.choose.registry, "registry", attn_backends.Registry())
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own exit for a bad option
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_distributed_takes_address_count_and_process(capsys):
    assert main(["--distributed", "127.0.0.1:1234,two,0", "list"]) == 2
    err = capsys.readouterr().err
    assert "--distributed: expected ADDRESS,COUNT,PROCESS" in err
    assert "'127.0.0.1:1234,two,0'" in err
