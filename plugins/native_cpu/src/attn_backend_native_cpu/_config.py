"""The options ``native_cpu`` takes (``backend_options={"native_cpu": NativeConfig(...)}``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NativeConfig:
    """How many threads the kernels use: 0 (the default) for every thread of
    XLA's intra-op pool, n > 0 for at most n (the calling thread among them).

    The answer is the same bit for bit at any count: each work item (a block
    of query rows, or of keys for dk/dv) writes outputs no other item writes.
    """

    threads: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"NativeConfig: threads must be an int >= 0 (0: XLA's whole pool), "
                             f"got {self.threads!r}")
