"""Block sizes for the Pallas Triton kernel: a frozen config that checks itself.

Constraints (from ``jax.experimental.pallas.ops.gpu.attention``): Triton tiles
are powers of two and its dot needs at least 16 rows per side; each block
divides the sequence it tiles (the adapter pads T up to the largest block);
the fused backward grid walks q in ``block_q_dq`` steps over as many blocks as
k has ``block_kv_dkv`` blocks, so with Tq == Tk those two are equal.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from attn_backends import AttentionCall

MIN_BLOCK = 16

# The kernel's own defaults (BlockSizes.get_default in jax 0.10-0.12): forward
# 128 x 128, backward 32 x 32. Not tuned on hardware in this project.
_GPU = dict(block_q=128, block_k=128, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32,
            block_kv_dq=32)
# Interpret mode on CPU: the smallest legal tiles, so the suite's short
# sequences (17, 129) still run several tiles forward and backward.
_INTERPRET = dict.fromkeys(_GPU, MIN_BLOCK)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class TritonBlockSizes:
    """Tile sizes of the forward and fused backward kernels (pass as ``options``).

    ``num_warps`` None lets the kernel choose (4 for D <= 64, else 8);
    ``num_stages`` is the forward software-pipelining depth.
    """

    block_q: int = 128
    block_k: int = 128
    block_q_dkv: int = 32
    block_kv_dkv: int = 32
    block_q_dq: int = 32
    block_kv_dq: int = 32
    num_warps: int | None = None
    num_stages: int = 2

    _BLOCKS: ClassVar[tuple[str, ...]] = (
        "block_q", "block_k", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq",
    )

    def __post_init__(self) -> None:
        for name in self._BLOCKS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < MIN_BLOCK:
                raise ValueError(f"{name}={value!r} must be an int >= {MIN_BLOCK}")
            if value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two (Triton tiles)")
        if self.block_q_dq != self.block_kv_dkv:
            raise ValueError(
                f"{self.block_q_dq=} must equal {self.block_kv_dkv=}: the fused backward "
                "needs as many q blocks as kv blocks, and Tq == Tk here"
            )
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{self.num_warps=} must be None or a power of two <= 16")
        if self.num_stages < 1:
            raise ValueError(f"{self.num_stages=} must be >= 1")

    @property
    def multiple(self) -> int:
        """T is padded to a multiple of this (every block, a power of two, divides it)."""
        return max(getattr(self, n) for n in self._BLOCKS)

    def padded(self, length: int) -> int:
        """``length`` rounded up to :attr:`multiple`: the length the kernel sees."""
        return _round_up(length, self.multiple)

    @classmethod
    def default_for(cls, call: AttentionCall, interpret: bool = False) -> TritonBlockSizes:
        """The kernel's defaults (or the interpret row), shrunk for short sequences.

        A block never exceeds the next power of two of the sequence, so a short
        call is padded by less than itself.
        """
        row = _INTERPRET if interpret else _GPU
        cap = max(MIN_BLOCK, _next_pow2(call.q_len))
        return cls(**{name: min(size, cap) for name, size in row.items()})

    def to_kernel(self, attention_module: Any) -> Any:
        """The kernel's own ``BlockSizes`` (``attention_module`` is pallas.ops.gpu.attention)."""
        return attention_module.BlockSizes(
            block_q=self.block_q,
            block_k=self.block_k,
            block_q_dkv=self.block_q_dkv,
            block_kv_dkv=self.block_kv_dkv,
            block_q_dq=self.block_q_dq,
            block_kv_dq=self.block_kv_dq,
        )


# The paged kernel's defaults on a GPU (jax.experimental.pallas.ops.gpu.paged_attention,
# jax 0.10-0.12): 16 query heads per program, 8 pages of 16 (128 keys) per compute
# block, 16 partitions of the table, 8 warps, 2 stages. Not tuned on hardware here.
_PAGED_GPU_KEYS = 128
_PAGED_GPU_SPLITS = 16
# Interpret mode: 16-key blocks and 2 partitions, so short test sequences cross
# several compute blocks and both partitions.
_PAGED_INTERPRET_KEYS = MIN_BLOCK
_PAGED_INTERPRET_SPLITS = 2


@dataclasses.dataclass(frozen=True)
class TritonPagedBlocks:
    """Blocks of the paged kernel (pass as ``options`` to ``get_paged``).

    ``pages_per_compute_block`` pages are one compute block: its keys
    (``pages_per_compute_block * page_size``) must be a power of two >= 16,
    Triton's dot; ``k_splits`` partitions of the page table run as separate
    programs (fewer when the table is narrower); ``block_h`` query heads of one
    kv head per program (a multiple of 16: Triton's dot needs 16 rows).
    """

    pages_per_compute_block: int
    k_splits: int
    block_h: int = 16
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("pages_per_compute_block", "k_splits", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.block_h, int) or self.block_h < MIN_BLOCK \
                or self.block_h % MIN_BLOCK:
            raise ValueError(f"block_h must be a multiple of {MIN_BLOCK} (Triton's dot needs "
                             f"{MIN_BLOCK} rows), got {self.block_h!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps!r}")

    def block_keys(self, page_size: int) -> int:
        """Keys per compute block for ``page_size``; ValueError unless a power of two >= 16."""
        keys = self.pages_per_compute_block * page_size
        if keys < MIN_BLOCK or keys & (keys - 1):
            raise ValueError(
                f"pages_per_compute_block={self.pages_per_compute_block} with page_size="
                f"{page_size} makes compute blocks of {keys} keys; expected a power of two "
                f">= {MIN_BLOCK} (Triton's dot and block shapes)")
        return keys

    @classmethod
    def default_for(cls, page_size: int, interpret: bool) -> TritonPagedBlocks:
        """The kernel's defaults (128-key blocks, 16 partitions), or the interpret row
        (16-key blocks, 2 partitions); ``page_size`` a power of two."""
        keys = _PAGED_INTERPRET_KEYS if interpret else _PAGED_GPU_KEYS
        splits = _PAGED_INTERPRET_SPLITS if interpret else _PAGED_GPU_SPLITS
        return cls(pages_per_compute_block=max(1, keys // page_size), k_splits=splits)
