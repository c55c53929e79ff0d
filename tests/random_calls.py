"""Random contract calls checked against the float64 oracle (shared by the test and the soak).

``python tests/random_calls.py --calls 3000`` runs the soak: thousands of
random calls through the registry with one persistent cache, each result
checked against the oracle; it prints every quarantine and every wrong
answer, and exits non-zero if there is either.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_backends import oracle, tolerances

DTYPES = ("float32", "bfloat16", "float16")
#: Keyword arguments that are Python values, not arrays (static under jit).
STATIC = ("causal", "window", "softcap", "return_lse")


@dataclasses.dataclass
class RandomCall:
    """One call: float32 NumPy q ``[B,Tq,Hq,D]``, k, v ``[B,Tk,Hkv,D]``, the kwargs, and
    whether its gradients are checked too."""

    dtype: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kwargs: dict[str, Any]
    grad: bool
    d_out: np.ndarray

    def describe(self) -> str:
        flags = ",".join(f"{k}" for k, v in self.kwargs.items() if v is not None and v is not False)
        return (f"q{list(self.q.shape)} kv{list(self.k.shape)} {self.dtype} {flags}"
                f"{' +grad' if self.grad else ''}")


def _length(rng: np.random.Generator) -> int:
    """Lengths from 1 up: 1 and 2 often (decode), else up to 90."""
    return int(rng.choice([1, 2, int(rng.integers(3, 17)), int(rng.integers(17, 91))],
                          p=[0.2, 0.1, 0.3, 0.4]))


def _broadcast(rng: np.random.Generator, b: int, hq: int, tq: int, tk: int) -> tuple[int, ...]:
    return (int(rng.choice([1, b])), int(rng.choice([1, hq])), tq, tk)


def draw(rng: np.random.Generator, grad_share: float = 0.3,
         heads: tuple[int, int] | None = None) -> RandomCall:
    """A random call using each feature of the contract about a third of the time.

    ``heads``: (Hq, Hkv) to use instead of random ones.
    """
    b, tq, tk = int(rng.integers(1, 3)), _length(rng), _length(rng)
    hkv = int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 2, 4]))
    if heads is not None:
        hq, hkv = heads
    d = int(rng.choice([8, 16]))
    dtype = str(rng.choice(DTYPES))
    on = lambda: bool(rng.random() < 0.35)  # noqa: E731
    kw: dict[str, Any] = {"causal": on(), "return_lse": on()}
    if on():
        kw["window"] = tuple(None if rng.random() < 0.3 else int(rng.integers(0, 12)) for _ in range(2))
        if kw["window"] == (None, None):
            kw["window"] = (3, None)
    if on():
        kw["segment_ids"] = (np.sort(rng.integers(0, 3, (b, tq))).astype(np.int32),
                             np.sort(rng.integers(0, 3, (b, tk))).astype(np.int32))
    if on():
        kw["q_lengths"] = rng.integers(0, tq + 1, (b,)).astype(np.int32)
    if on():
        kw["kv_lengths"] = rng.choice([0, 1, int(rng.integers(0, tk + 1)), tk], size=b).astype(np.int32)
    if on():
        kw["mask"] = rng.random(_broadcast(rng, b, hq, tq, tk)) < 0.7
    if on():
        kw["bias"] = rng.normal(size=_broadcast(rng, b, hq, tq, tk)).astype(np.float32)
    if on():
        kw["softcap"] = float(rng.choice([5.0, 30.0]))
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    return RandomCall(dtype, normal(b, tq, hq, d), normal(b, tk, hkv, d), normal(b, tk, hkv, d),
                      kw, bool(rng.random() < grad_share), normal(b, tq, hq, d))


def _jax_kwargs(rc: RandomCall) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in rc.kwargs.items():
        if name == "segment_ids":
            out[name] = tuple(jnp.asarray(x) for x in value)
        elif name == "bias":
            out[name] = jnp.asarray(value, rc.dtype)
        elif isinstance(value, np.ndarray):
            out[name] = jnp.asarray(value)
        else:
            out[name] = value
    return out


def _compare(what: str, got: Any, want: Any, scale: Any, dtype: str) -> str | None:
    error = tolerances.normalised_error(got, want, tolerances.tolerance(dtype, what, platform="cpu"),
                                        magnitude=scale)
    return None if error <= 1.0 else f"{what}: {error:.3g}x its tolerance"


def run_one(attention: Any, rc: RandomCall) -> list[str]:
    """Run ``rc`` through ``attention`` and compare with the oracle; returns what differs."""
    q, k, v = (jnp.asarray(x, rc.dtype) for x in (rc.q, rc.k, rc.v))
    kw = _jax_kwargs(rc)
    # The oracle sees exactly the rounded inputs the backend sees.
    qf, kf, vf = (np.asarray(x, np.float64) for x in (q, k, v))
    okw = {n: (np.asarray(kw[n], np.float64) if n == "bias" else rc.kwargs[n])
           for n in rc.kwargs if n != "return_lse"}
    d_out = np.asarray(jnp.asarray(rc.d_out, rc.dtype), np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        want_out, want_lse = oracle.attention(qf, kf, vf, **okw)
        scale = oracle.magnitudes(qf, kf, vf, d_out, **okw)
    problems = []
    if rc.grad:
        def f(q: Any, k: Any, v: Any) -> Any:
            result = attention(q, k, v, **kw)
            return result[0] if rc.kwargs.get("return_lse") else result

        def out_and_grads(q: Any, k: Any, v: Any, ct: Any) -> Any:
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(ct)

        out, grads = jax.jit(out_and_grads)(q, k, v, jnp.asarray(d_out, rc.dtype))
        with np.errstate(invalid="ignore", divide="ignore"):
            want = oracle.attention_vjp(qf, kf, vf, d_out, **okw)
        for name, g in zip(("q", "k", "v"), grads):
            problems.append(_compare(f"d{name}", g, want[name], scale[f"d{name}"], rc.dtype))
    else:
        static = {n: x for n, x in kw.items() if n in STATIC}
        arrays = {n: x for n, x in kw.items() if n not in STATIC}
        result = jax.jit(lambda q, k, v, arrays: attention(q, k, v, **arrays, **static))(q, k, v, arrays)
        out = result[0] if rc.kwargs.get("return_lse") else result
        if rc.kwargs.get("return_lse"):
            problems.append(_compare("lse", result[1], want_lse, scale["lse"], rc.dtype))
    problems.append(_compare("out", out, want_out, scale["out"], rc.dtype))
    return [p for p in problems if p]


def main(argv: list[str] | None = None) -> int:
    import attn_backends as ab
    from attn_backends import _probe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    attention = ab.registry.get(device="cpu", fallback="silent")
    wrong = 0
    start = time.perf_counter()
    for i in range(args.calls):
        rc = draw(rng)
        problems = run_one(attention, rc)
        if problems:
            wrong += 1
            print(f"WRONG #{i} {rc.describe()}: {problems}")
        if (i + 1) % 100 == 0:
            print(f"{i + 1} calls, {wrong} wrong, {time.perf_counter() - start:.0f} s", flush=True)
    quarantined = _probe.quarantined()
    for record in quarantined:
        print(f"QUARANTINED {record['key']['backend']} on {record['probe_call']}: {record['reasons']}")
    print(f"{args.calls} calls: {wrong} wrong answers, {len(quarantined)} quarantined verdicts")
    return 1 if wrong or quarantined else 0


if __name__ == "__main__":
    sys.exit(main())
