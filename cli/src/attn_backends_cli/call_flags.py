"""The flags that describe a dense call (``explain``, ``tune``), the call they
describe, and the argparse types of the command's flags."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from attn_backends.contract.call import QUANTIZED_KV_DTYPES, AttentionKeywords
from attn_backends.contract.capabilities import DTYPES
from attn_backends.contract.environment import expected

T = TypeVar("T")


def _argument(parse: Callable[[str], T], accepts: str) -> Callable[[str], T]:
    """An argparse type: ``parse``, whose ValueError reads like the contract's
    (:func:`~attn_backends.contract.environment.expected`); argparse names the
    flag: ``argument --heads: expected an integer >= 1, got '0'``."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(expected(accepts, text)) from None

    convert.__name__ = accepts  # what argparse would show for any other error
    return convert


def _at_least_1(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _above_0(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


def ints(count: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: ``count`` comma-separated integers, as a tuple (a shape)."""

    def parse(text: str) -> tuple[int, ...]:
        values = tuple(int(x) for x in text.split(","))
        if len(values) != count:
            raise ValueError(text)
        return values

    return _argument(parse, f"{count} comma-separated integers like 1,128,8,64")


def _window_sides(text: str) -> tuple[int | None, int | None]:
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(text)
    left, right = (int(p) if p.strip() not in ("", "none", "None") else None for p in parts)
    return left, right


def _lengths(text: str) -> list[int]:
    return [_at_least_1(x) for x in text.split(",")]


positive = _argument(_at_least_1, "an integer >= 1")
seq_lengths = _argument(_lengths, "comma-separated lengths >= 1 like 512,1024")
margin = _argument(_above_0, "a fraction > 0 like 0.05")
_window = _argument(_window_sides, "LEFT,RIGHT: two integers, either may be empty")
_softcap = _argument(_above_0, "a number > 0")


def add_call_flags(parser: argparse.ArgumentParser) -> None:
    """The flags describing a dense call besides --q and --kv (explain, tune)."""
    parser.add_argument("--layout", default="BTNH", choices=("BTNH", "BHTD"),
                        help="the axis order of --q and --kv (default: BTNH)")
    parser.add_argument("--dv", type=positive, default=None, help="value head dim (default: D)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=_window, default=None, metavar="LEFT,RIGHT")
    parser.add_argument("--segment-ids", action="store_true")
    parser.add_argument("--q-lengths", action="store_true")
    parser.add_argument("--kv-lengths", action="store_true")
    masks = parser.add_mutually_exclusive_group()
    masks.add_argument("--mask", action="store_true", help="a dense [B,Hq,Tq,Tk] bool mask")
    masks.add_argument("--key-mask", action="store_true",
                        help="a key mask [B,1,1,Tk] (padding, a decode cache's filled part)")
    parser.add_argument("--bias", action="store_true", help="a dense [B,Hq,Tq,Tk] bias")
    parser.add_argument("--softcap", type=_softcap, default=None)
    parser.add_argument("--return-lse", action="store_true")
    parser.add_argument("--kv-dtype", default=None, choices=QUANTIZED_KV_DTYPES,
                        help="K and V quantized in this dtype, with float32 scales [B,Tk,Hkv] "
                             "(with --paged: a cache stored quantized)")
    parser.add_argument("--cache-dtype", action=RenamedFlag, dest="kv_dtype",
                        choices=QUANTIZED_KV_DTYPES, help=argparse.SUPPRESS)


class RenamedFlag(argparse.Action):
    """A flag's old spelling: stores as the new one, and says so on stderr
    (``--cache-dtype`` is ``--kv-dtype`` since 0.2, one name for quantized K and V)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        new = "--" + self.dest.replace("_", "-")
        print(f"attn-backends: {option_string} is deprecated, use {new} (the same values)",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def call_arguments(args: argparse.Namespace) -> tuple[Any, Any, Any, AttentionKeywords]:
    """q, k, v (ShapeDtypeStructs in ``args.layout``) and the keyword arguments of
    the call the flags of :func:`add_call_flags` describe (the contract's
    :class:`~attn_backends.contract.call.AttentionKeywords`)."""
    import jax
    import jax.numpy as jnp

    if args.layout == "BHTD":
        (b, hq, tq, _), (bk, _, tk, dk) = args.q, args.kv
    else:
        (b, tq, hq, _), (bk, tk, _, dk) = args.q, args.kv
    dv = args.dv if args.dv is not None else dk
    dtype = jnp.dtype(args.dtype)
    sds = jax.ShapeDtypeStruct
    # q, k, v in the layout given (the attention transposes them); the rest is
    # the same in both.
    kv_dtype = dtype if args.kv_dtype is None else jnp.dtype(args.kv_dtype)
    q, k, v = sds(args.q, dtype), sds(args.kv, kv_dtype), sds((*args.kv[:3], dv), kv_dtype)
    kwargs: AttentionKeywords = {
        "causal": args.causal,
        "window": args.window,
        "softcap": args.softcap,
        "return_lse": args.return_lse,
    }
    if args.segment_ids:
        kwargs["segment_ids"] = (sds((b, tq), jnp.int32), sds((bk, tk), jnp.int32))
    if args.q_lengths:
        kwargs["q_lengths"] = sds((b,), jnp.int32)
    if args.kv_lengths:
        kwargs["kv_lengths"] = sds((b,), jnp.int32)
    if args.mask:
        kwargs["mask"] = sds((b, hq, tq, tk), jnp.bool_)
    if args.key_mask:
        kwargs["mask"] = sds((b, 1, 1, tk), jnp.bool_)
    if args.bias:
        kwargs["bias"] = sds((b, hq, tq, tk), dtype)
    if args.kv_dtype is not None:
        hkv = args.kv[1] if args.layout == "BHTD" else args.kv[2]
        kwargs["k_scales"] = kwargs["v_scales"] = sds((bk, tk, hkv), jnp.float32)
    return q, k, v, kwargs
