"""Block sizes for the splash kernels: a frozen config that checks itself, and defaults per TPU.

Constraints (from the splash kernels in ``jax.experimental.pallas.ops.tpu``):
every block is a multiple of 128 (the TPU lane width: kv blocks are laid along
lanes, and with segment ids the dkv kernel also lays q blocks along lanes); a
kv block is a whole number of its compute sub-blocks; each block divides the
sequence it tiles, so the adapter pads Tq and Tk up to a common multiple of
their blocks and masks the padding out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from attn_backends import AttentionCall

LANES = 128

# Forward (q, kv, kv_compute), dkv (q, kv, kv_compute), dq (q, kv) per TPU
# generation. Starting points sized for the scoped VMEM of each chip (16 MiB on
# v4/v5e, 32 MiB on v5p/v6e) with head dims up to 256 and double-buffered k/v;
# not tuned on hardware in this project. v6e has a 256-wide MXU, hence larger q.
_TABLE: dict[str, dict[str, int]] = {
    "v4": dict(q=512, kv=512, kvc=512, q_dkv=512, kv_dkv=512, kvc_dkv=512, q_dq=512, kv_dq=512),
    "v5e": dict(q=512, kv=1024, kvc=512, q_dkv=512, kv_dkv=1024, kvc_dkv=512, q_dq=512,
                kv_dq=1024),
    "v5p": dict(q=512, kv=1024, kvc=512, q_dkv=512, kv_dkv=1024, kvc_dkv=512, q_dq=512,
                kv_dq=1024),
    "v6e": dict(q=1024, kv=1024, kvc=512, q_dkv=1024, kv_dkv=1024, kvc_dkv=512, q_dq=1024,
                kv_dq=1024),
    # Interpret mode on CPU: the smallest legal tiles keep the emulator fast.
    "interpret": dict(q=128, kv=128, kvc=128, q_dkv=128, kv_dkv=128, kvc_dkv=128, q_dq=128,
                      kv_dq=128),
}
#: Row used for a TPU this table does not know, or when exporting from a host without one.
GENERIC = "v4"


def generation(device_kind: str | None) -> str:
    """Map a ``jax.Device.device_kind`` (e.g. ``"TPU v5 lite"``) to a row of the table.

    ``"cpu"`` (interpret mode) maps to ``"interpret"``; None or an unknown kind to
    :data:`GENERIC`.
    """
    if device_kind is None:
        return GENERIC
    kind = device_kind.lower().replace(" ", "")
    if kind == "cpu" or kind == "interpret":
        return "interpret"
    if "v6" in kind:
        return "v6e"
    if "v5lite" in kind or "v5e" in kind:
        return "v5e"
    if "v5" in kind:
        return "v5p"
    if "v4" in kind:
        return "v4"
    return GENERIC


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _fit(block: int, length: int) -> int:
    """Shrink ``block`` for a short sequence so padding wastes at most ~1/8 of it."""
    tight = _round_up(max(length, 1), LANES)
    block = min(block, tight)
    while block > LANES and _round_up(length, block) - tight > tight // 8:
        block = max(LANES, (block // 2) // LANES * LANES)
    return block


@dataclasses.dataclass(frozen=True)
class SplashBlockSizes:
    """Tile sizes of the splash forward, dkv and dq kernels (pass as ``options``).

    ``block_kv_compute`` / ``block_kv_dkv_compute`` default to their memory
    block. With ``use_fused_bwd_kernel`` dq comes out of the dkv kernel and the
    ``*_dq`` sizes are unused (leave them None).
    """

    block_q: int = 128
    block_kv: int = 128
    block_kv_compute: int | None = None
    block_q_dkv: int = 128
    block_kv_dkv: int = 128
    block_kv_dkv_compute: int | None = None
    block_q_dq: int | None = 128
    block_kv_dq: int | None = 128
    use_fused_bwd_kernel: bool = False

    _Q_FIELDS: ClassVar[tuple[str, ...]] = ("block_q", "block_q_dkv", "block_q_dq")
    _KV_FIELDS: ClassVar[tuple[str, ...]] = (
        "block_kv", "block_kv_compute", "block_kv_dkv", "block_kv_dkv_compute", "block_kv_dq",
    )

    def __post_init__(self) -> None:
        if self.block_kv_compute is None:
            object.__setattr__(self, "block_kv_compute", self.block_kv)
        if self.block_kv_dkv_compute is None:
            object.__setattr__(self, "block_kv_dkv_compute", self.block_kv_dkv)
        if self.use_fused_bwd_kernel and (self.block_q_dq, self.block_kv_dq) != (None, None):
            raise ValueError(
                f"{self.block_q_dq=} and {self.block_kv_dq=} must be None with "
                "use_fused_bwd_kernel=True (the fused kernel computes dq itself)"
            )
        if not self.use_fused_bwd_kernel and None in (self.block_q_dq, self.block_kv_dq):
            raise ValueError(
                f"{self.block_q_dq=} and {self.block_kv_dq=} must be set unless "
                "use_fused_bwd_kernel=True"
            )
        for name, value in self._blocks().items():
            if not isinstance(value, int) or isinstance(value, bool) or value < LANES:
                raise ValueError(f"{name}={value!r} must be an int >= {LANES}")
            if value % LANES:
                raise ValueError(f"{name}={value} must be a multiple of {LANES} (TPU lanes)")
        if self.block_kv % self.block_kv_compute:  # type: ignore[operator]
            raise ValueError(f"{self.block_kv=} must be a multiple of {self.block_kv_compute=}")
        if self.block_kv_dkv % self.block_kv_dkv_compute:  # type: ignore[operator]
            raise ValueError(
                f"{self.block_kv_dkv=} must be a multiple of {self.block_kv_dkv_compute=}"
            )

    def _blocks(self) -> dict[str, int]:
        return {
            name: getattr(self, name)
            for name in self._Q_FIELDS + self._KV_FIELDS
            if getattr(self, name) is not None
        }

    @property
    def q_multiple(self) -> int:
        """Tq is padded to a multiple of this (every q block divides it)."""
        return math.lcm(*(getattr(self, n) for n in self._Q_FIELDS if getattr(self, n)))

    @property
    def kv_multiple(self) -> int:
        """Tk is padded to a multiple of this (every kv block divides it)."""
        return math.lcm(*(getattr(self, n) for n in self._KV_FIELDS if getattr(self, n)))

    def padded(self, call: AttentionCall) -> tuple[int, int]:
        """(Tq, Tk) rounded up to the block multiples: the lengths the kernels see."""
        return _round_up(call.q_len, self.q_multiple), _round_up(call.kv_len, self.kv_multiple)

    @classmethod
    def default_for(cls, call: AttentionCall, device_kind: str | None = None) -> SplashBlockSizes:
        """The table's row for ``device_kind``, shrunk to fit short sequences of ``call``."""
        row = _TABLE[generation(device_kind)]
        q = {k: _fit(v, call.q_len) for k, v in row.items() if k.startswith("q")}
        kv = {k: _fit(v, call.kv_len) for k, v in row.items() if not k.startswith("q")}
        # A fitted compute block must still divide its (fitted) memory block.
        kv["kvc"] = math.gcd(kv["kvc"], kv["kv"])
        kv["kvc_dkv"] = math.gcd(kv["kvc_dkv"], kv["kv_dkv"])
        return cls(
            block_q=q["q"],
            block_kv=kv["kv"],
            block_kv_compute=kv["kvc"],
            block_q_dkv=q["q_dkv"],
            block_kv_dkv=kv["kv_dkv"],
            block_kv_dkv_compute=kv["kvc_dkv"],
            block_q_dq=q["q_dq"],
            block_kv_dq=kv["kv_dq"],
        )

    def to_splash(self, splash_module: Any) -> Any:
        """The kernel's own ``BlockSizes`` (``splash_module`` is splash_attention_kernel)."""
        return splash_module.BlockSizes(
            block_q=self.block_q,
            block_kv=self.block_kv,
            block_kv_compute=self.block_kv_compute,
            block_q_dkv=self.block_q_dkv,
            block_kv_dkv=self.block_kv_dkv,
            block_kv_dkv_compute=self.block_kv_dkv_compute,
            block_q_dq=self.block_q_dq,
            block_kv_dq=self.block_kv_dq,
            use_fused_bwd_kernel=self.use_fused_bwd_kernel,
        )
