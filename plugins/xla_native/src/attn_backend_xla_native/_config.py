"""Block sizes of the blockwise kernel: a frozen config that checks itself."""

from __future__ import annotations

from dataclasses import dataclass

from attn_backends.authoring import AttentionCall, PagedCall

# Large blocks amortise the per-iteration overhead of XLA loops (and, on
# accelerators, kernel launches); the budget caps one logits tile, which holds
# every (batch, head) pair: batch * q_heads * block_q * block_kv float32s. On
# CPU the forward ran 5-10% faster with 512 x 256 than 512 x 512 (half the
# tile memory keeps its temporaries small enough to be reused from the heap
# rather than mapped and page-faulted on every call) and the backward about
# 10% faster with 512 x 512 (BENCHMARKS.md, "Block sizes on cpu").
_DEFAULT_BLOCKS = {"cpu": (512, 256), "gpu": (256, 256), "tpu": (512, 512)}
_DEFAULT_BACKWARD_BLOCKS = {"cpu": (512, 512), "gpu": (256, 256), "tpu": (512, 512)}
_TILE_BUDGET = {"cpu": 1 << 22, "gpu": 1 << 24, "tpu": 1 << 24}
_MIN_BLOCK = 64


@dataclass(frozen=True)
class BlockConfig:
    """Query and key/value block sizes (rows per tile) of the blockwise kernel.

    ``block_q`` query positions (times the GQA group) and ``block_kv`` keys
    form one tile of logits in the forward pass; ``block_q_bwd`` and
    ``block_kv_bwd`` do the same for the backward pass (None: the forward's).
    Sequence lengths need not be multiples: the kernel pads internally and
    masks the padding.
    """

    block_q: int
    block_kv: int
    block_q_bwd: int | None = None
    block_kv_bwd: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            value = getattr(self, name)
            if value is None and name.endswith("_bwd"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"BlockConfig: {name} must be an int, got {type(value).__name__} {value!r}"
                )
            if value < 1:
                raise ValueError(f"BlockConfig: {name}={value} must be >= 1")

    def backward(self) -> BlockConfig:
        """The blocks the backward pass runs with, as a forward-only config."""
        return BlockConfig(self.block_q_bwd or self.block_q, self.block_kv_bwd or self.block_kv)

    @classmethod
    def default_for(cls, call: AttentionCall, platform: str = "cpu") -> BlockConfig:
        """Blocks for ``call`` on ``platform`` (``cpu``, ``gpu`` or ``tpu``).

        Blocks shrink (not below 64) while one logits tile of all batch rows
        and heads exceeds the platform's budget, and never exceed their
        sequence length, so short or decode-style calls do not pay for
        padding up to a large block.
        """
        if platform not in _DEFAULT_BLOCKS:
            raise ValueError(
                f"BlockConfig.default_for: platform={platform!r}, expected one of "
                f"{sorted(_DEFAULT_BLOCKS)}"
            )
        forward = _fit(call, platform, *_DEFAULT_BLOCKS[platform])
        backward = _fit(call, platform, *_DEFAULT_BACKWARD_BLOCKS[platform])
        return cls(*forward, *backward)


def _fit(call: AttentionCall, platform: str, block_q: int, block_kv: int) -> tuple[int, int]:
    """``(block_q, block_kv)`` cut to the sequence lengths and the tile budget."""
    block_q = min(block_q, max(call.q_len, 1))
    block_kv = min(block_kv, max(call.kv_len, 1))
    heads = max(call.batch * call.q_heads, 1)
    while heads * block_q * block_kv > _TILE_BUDGET[platform]:
        if block_q >= block_kv and block_q > _MIN_BLOCK:
            block_q = max(block_q // 2, _MIN_BLOCK)
        elif block_kv > _MIN_BLOCK:
            block_kv = max(block_kv // 2, _MIN_BLOCK)
        else:
            break
    return block_q, block_kv


#: Keys one block holds by default: enough to amortise a loop iteration, small
#: enough that a decode step's gather stays a few rows of the cache.
_BLOCK_KEYS = 128
#: Query rows of one sequence per tile (prefill chunks): one gather of a block
#: of pages serves them all.
_ROWS_PER_TILE = 16
#: Tiles one loop step runs side by side: few enough that a group's tiles share
#: a key range (its loop runs to the longest of them) and a group's block of
#: keys stays in cache. On cpu, in the heads_first layout, the benchmark's
#: decode step ran as fast with groups of 1 or 2 and 29% slower with 4, its
#: mixed batch fastest with 2 (BENCHMARKS.md, "Paged attention").
_TILES_PER_GROUP = 2


@dataclass(frozen=True)
class PagedConfig:
    """Pages per block, query rows per tile and tiles per group of the paged
    kernel (each an int >= 1).

    A tile holds up to ``rows_per_tile`` rows of one sequence with more than
    one row (a prefill chunk); a sequence of one row (a decode step) is a tile
    of one row whatever ``rows_per_tile`` says. ``tiles_per_group`` tiles of a
    kind run side by side, each group over its own rows' blocks of keys.
    """

    pages_per_block: int
    rows_per_tile: int = _ROWS_PER_TILE
    tiles_per_group: int = _TILES_PER_GROUP

    def __post_init__(self) -> None:
        for name in ("pages_per_block", "rows_per_tile", "tiles_per_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedConfig: {name} must be an int >= 1, got {value!r}")

    @classmethod
    def default_for(cls, call: PagedCall) -> PagedConfig:
        """About :data:`_BLOCK_KEYS` keys per block, at least one page."""
        return cls(max(1, _BLOCK_KEYS // call.page_size))
