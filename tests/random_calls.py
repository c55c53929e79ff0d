"""Random contract calls checked against the float64 oracle (shared by the test and the soak).

``python tests/random_calls.py --calls 3000`` runs the soak: thousands of
random calls through the registry with one persistent cache, each result
checked against the oracle; it prints every quarantine and every wrong
answer, and exits non-zero if there is either. Some of the calls (about
:data:`QUANTIZED_SHARE` of the signatures :func:`draw_many` draws) read a
quantized K and V (int8 mostly, float8 sometimes) with their float32 scales:
forward only, checked against the oracle on the dequantized values.
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
#: The quantized K and V dtypes a signature may draw, and how often each.
KV_DTYPES = (("int8", 0.5), ("float8_e4m3fn", 0.25), ("float8_e5m2", 0.25))
#: The share of :func:`draw_many`'s signatures with a quantized K and V.
QUANTIZED_SHARE = 0.25
#: Lengths up to this are a shape class of their own in a probe verdict.
SHORT = 16
#: Keyword arguments that are Python values, not arrays (static under jit).
STATIC = ("causal", "window", "softcap", "return_lse")


@dataclasses.dataclass
class RandomCall:
    """One call: float32 NumPy q ``[B,Tq,Hq,D]``, k, v ``[B,Tk,Hkv,D]``, the kwargs, and
    whether its gradients are checked too. With ``kv_dtype``, k and v hold that
    dtype's values and the kwargs their float32 scales ``[B,Tk,Hkv]`` (k_scales,
    v_scales); such a call is forward only."""

    dtype: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kwargs: dict[str, Any]
    grad: bool
    d_out: np.ndarray
    kv_dtype: str | None = None

    def describe(self) -> str:
        flags = ",".join(f"{k}" for k, v in self.kwargs.items()
                         if v is not None and v is not False and not k.endswith("_scales"))
        kv = f" kv={self.kv_dtype}" if self.kv_dtype else ""
        return (f"q{list(self.q.shape)} kv{list(self.k.shape)} {self.dtype}{kv} {flags}"
                f"{' +grad' if self.grad else ''}")


def _length(rng: np.random.Generator) -> int:
    """Lengths from 1 up: 1 and 2 often (decode), else up to 90."""
    return int(rng.choice([1, 2, int(rng.integers(3, 17)), int(rng.integers(17, 91))],
                          p=[0.2, 0.1, 0.3, 0.4]))


@dataclasses.dataclass(frozen=True)
class Signature:
    """What one probe verdict is about: everything of a call but its values and
    the exact lengths of long sequences (over 16 tokens)."""

    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    features: frozenset[str]
    window: tuple[int | None, int | None] | None
    softcap: float | None
    mask_shape: tuple[bool, bool]  # (batch broadcast, head broadcast)
    bias_shape: tuple[bool, bool]
    kv_dtype: str | None = None  # a quantized K and V's dtype


def signature(rng: np.random.Generator, heads: tuple[int, int] | None = None,
              quantized_share: float = 0.0) -> Signature:
    """A random signature using each feature of the contract about a third of the time.

    ``heads``: (Hq, Hkv) to use instead of random ones. ``quantized_share``: how
    often K and V are quantized (a :data:`KV_DTYPES` dtype); at 0 no number is
    drawn for it, so the rest of the draw is what it was without it.
    """
    hkv = int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 2, 4]))
    if heads is not None:
        hq, hkv = heads
    names = ("causal", "return_lse", "window", "segment_ids", "q_lengths", "kv_lengths", "mask",
             "bias", "softcap")
    features = frozenset(n for n in names if rng.random() < 0.35)
    window = tuple(None if rng.random() < 0.3 else int(rng.integers(0, 12)) for _ in range(2))
    return Signature(
        batch=int(rng.integers(1, 3)), q_len=_length(rng), kv_len=_length(rng), q_heads=hq,
        kv_heads=hkv, head_dim=int(rng.choice([8, 16])), dtype=str(rng.choice(DTYPES)),
        features=features,
        window=(window if window != (None, None) else (3, None)) if "window" in features else None,
        softcap=float(rng.choice([5.0, 30.0])) if "softcap" in features else None,
        mask_shape=(bool(rng.random() < 0.5), bool(rng.random() < 0.5)),
        bias_shape=(bool(rng.random() < 0.5), bool(rng.random() < 0.5)),
        kv_dtype=(str(rng.choice([n for n, _ in KV_DTYPES], p=[p for _, p in KV_DTYPES]))
                  if quantized_share and rng.random() < quantized_share else None),
    )


def _long_lengths(rng: np.random.Generator, sig: Signature) -> tuple[int, int]:
    """New lengths for ``sig``: short ones kept, long ones re-drawn in 17..90
    keeping whether Tq <, ==, > Tk (the probe's length classes)."""
    tq, tk = sig.q_len, sig.kv_len
    if tq > SHORT and tk > SHORT:
        a, b = sorted(int(x) for x in rng.choice(np.arange(SHORT + 1, 91), 2, replace=False))
        return (a, a) if tq == tk else (a, b) if tq < tk else (b, a)
    pick = lambda t: t if t <= SHORT else int(rng.integers(SHORT + 1, 91))  # noqa: E731
    return pick(tq), pick(tk)


def draw(rng: np.random.Generator, grad_share: float = 0.3, heads: tuple[int, int] | None = None,
         sig: Signature | None = None, lengths: tuple[int, int] | None = None) -> RandomCall:
    """A random call of signature ``sig`` (a new random one when None), every
    value drawn anew, and its long lengths too unless ``lengths`` gives them."""
    sig = signature(rng, heads) if sig is None else sig
    b, hq, hkv, d, on = sig.batch, sig.q_heads, sig.kv_heads, sig.head_dim, sig.features
    tq, tk = _long_lengths(rng, sig) if lengths is None else lengths
    kw: dict[str, Any] = {"causal": "causal" in on, "return_lse": "return_lse" in on}
    if sig.window is not None:
        kw["window"] = sig.window
    if "segment_ids" in on:
        kw["segment_ids"] = (np.sort(rng.integers(0, 3, (b, tq))).astype(np.int32),
                             np.sort(rng.integers(0, 3, (b, tk))).astype(np.int32))
    if "q_lengths" in on:
        kw["q_lengths"] = rng.integers(0, tq + 1, (b,)).astype(np.int32)
    if "kv_lengths" in on:
        kw["kv_lengths"] = rng.choice([0, 1, int(rng.integers(0, tk + 1)), tk],
                                      size=b).astype(np.int32)
    broadcast = lambda ones: (1 if ones[0] else b, 1 if ones[1] else hq, tq, tk)  # noqa: E731
    if "mask" in on:
        kw["mask"] = rng.random(broadcast(sig.mask_shape)) < 0.7
    if "bias" in on:
        kw["bias"] = rng.normal(size=broadcast(sig.bias_shape)).astype(np.float32)
    if sig.softcap is not None:
        kw["softcap"] = sig.softcap
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    q, k, v = normal(b, tq, hq, d), normal(b, tk, hkv, d), normal(b, tk, hkv, d)
    grad = bool(rng.random() < grad_share)
    if sig.kv_dtype is not None:  # by the contract's rule; forward only
        (k, kw["k_scales"]), (v, kw["v_scales"]) = (
            oracle.quantize_rows(x, sig.kv_dtype) for x in (k, v))
        grad = False
    return RandomCall(sig.dtype, q, k, v, kw, grad, normal(b, tq, hq, d), sig.kv_dtype)


def draw_many(rng: np.random.Generator, calls: int, per_signature: int,
              quantized_share: float = QUANTIZED_SHARE) -> list[RandomCall]:
    """``calls`` random calls, ``per_signature`` of each random signature, as a
    model makes them: new values in the same shapes (one compiled program),
    and the last of each signature at other long lengths (one verdict serves
    it too); about ``quantized_share`` of the signatures with a quantized K and V."""
    out: list[RandomCall] = []
    while len(out) < calls:
        sig = signature(rng, quantized_share=quantized_share)
        same = _long_lengths(rng, sig)
        count = min(per_signature, calls - len(out))
        out += [draw(rng, sig=sig, lengths=same if i < count - 1 else None) for i in range(count)]
    return out


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
    """Core's verdict (the probe's and the suite's): why ``got`` disagrees, or None."""
    tol = tolerances.tolerance(dtype, what, platform="cpu")
    wrong = tolerances.compare(what, got, want, tol, scale)
    return None if wrong is None else str(wrong)


#: Jitted programs by (attention, static kwargs, gradient or not): calls of one
#: signature and shape reuse their compiled program, as a model's steps do.
_PROGRAMS: dict[tuple[int, tuple, bool], Any] = {}


def _program(attention: Any, static: tuple, grad: bool) -> Any:
    key = (id(attention), static, grad)
    if key not in _PROGRAMS:
        kwargs = dict(static)

        def forward(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
            return attention(q, k, v, **arrays, **kwargs)

        def training(q: Any, k: Any, v: Any, arrays: dict[str, Any], ct: Any) -> Any:
            def out_only(q: Any, k: Any, v: Any) -> Any:
                result = forward(q, k, v, arrays)
                return result[0] if kwargs.get("return_lse") else result

            out, vjp = jax.vjp(out_only, q, k, v)
            return out, vjp(ct)

        _PROGRAMS[key] = jax.jit(training if grad else forward)
    return _PROGRAMS[key]


def run_one(attention: Any, rc: RandomCall) -> list[str]:
    """Run ``rc`` through ``attention`` and compare with the oracle; returns what differs."""
    q = jnp.asarray(rc.q, rc.dtype)
    kw = _jax_kwargs(rc)
    # The oracle sees exactly the rounded inputs the backend sees; a quantized
    # K and V as value * scale, exactly.
    if rc.kv_dtype is None:
        k, v = (jnp.asarray(x, rc.dtype) for x in (rc.k, rc.v))
        kf, vf = (np.asarray(x, np.float64) for x in (k, v))
    else:
        k, v = jnp.asarray(rc.k), jnp.asarray(rc.v)
        kf, vf = (oracle.dequantize_rows(x, rc.kwargs[f"{n}_scales"])
                  for n, x in (("k", rc.k), ("v", rc.v)))
    qf = np.asarray(q, np.float64)
    okw = {n: (np.asarray(kw[n], np.float64) if n == "bias" else rc.kwargs[n])
           for n in rc.kwargs if n not in ("return_lse", "k_scales", "v_scales")}
    d_out = np.asarray(jnp.asarray(rc.d_out, rc.dtype), np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        want_out, want_lse = oracle.attention(qf, kf, vf, **okw)
        scale = oracle.magnitudes(qf, kf, vf, d_out, **okw)
    problems = []
    static = tuple(sorted((n, x) for n, x in kw.items() if n in STATIC))
    arrays = {n: x for n, x in kw.items() if n not in STATIC}
    program = _program(attention, static, rc.grad)
    if rc.grad:
        out, grads = program(q, k, v, arrays, jnp.asarray(d_out, rc.dtype))
        with np.errstate(invalid="ignore", divide="ignore"):
            want = oracle.attention_vjp(qf, kf, vf, d_out, **okw)
        for name, g in zip(("q", "k", "v"), grads, strict=True):
            problems.append(_compare(f"d{name}", g, want[name], scale[f"d{name}"], rc.dtype))
    else:
        result = program(q, k, v, arrays)
        out = result[0] if rc.kwargs.get("return_lse") else result
        if rc.kwargs.get("return_lse"):
            problems.append(_compare("lse", result[1], want_lse, scale["lse"], rc.dtype))
    problems.append(_compare("out", out, want_out, scale["out"], rc.dtype))
    return [p for p in problems if p]


def main(argv: list[str] | None = None) -> int:
    import attn_backends as ab
    from attn_backends.probe import prober as _probe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-signature", type=int, default=1,
                        help="calls per random signature (a verdict serves them all)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    attention = ab.registry.get(device="cpu", fallback="silent")
    wrong = 0
    start = time.perf_counter()
    for i, rc in enumerate(draw_many(rng, args.calls, args.per_signature)):
        problems = run_one(attention, rc)
        if problems:
            wrong += 1
            print(f"WRONG #{i} {rc.describe()}: {problems}")
        if (i + 1) % 100 == 0:
            print(f"{i + 1} calls, {wrong} wrong, {time.perf_counter() - start:.0f} s", flush=True)
    quarantined = _probe.quarantined()
    for record in quarantined:
        print(f"QUARANTINED {record['key']['backend']} on {record['probe_call']}: "
              f"{record['reasons']}")
    print(f"{args.calls} calls: {wrong} wrong answers, {len(quarantined)} quarantined verdicts")
    return 1 if wrong or quarantined else 0


if __name__ == "__main__":
    sys.exit(main())
