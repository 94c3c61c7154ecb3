"""Runtime settings."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("eager", "compile", "cudagraph")


@dataclass(frozen=True)
class RuntimeConfig:
    """Static sizes of a Runtime: everything is preallocated for `max_batch` x `max_len`.

    backend: `eager` (the round as plain torch), `compile` (torch.compile, fullgraph, fixed
    shapes), or `cudagraph` (compiled and captured as CUDA graphs; CUDA only).
    batch_buckets: batch sizes the round is built for (default: powers of two up to
    max_batch); a step runs the smallest bucket that covers the live rows.
    length_buckets: cache lengths the round is built for (default: powers of two from 128
    up to max_len); a step attends over the smallest one that covers every live request's
    next block, so attention costs what the live requests need, not max_len.
    """

    max_batch: int = 8
    max_len: int = 4096
    backend: str = "eager"
    block_size: int | None = None
    batch_buckets: tuple[int, ...] | None = None
    length_buckets: tuple[int, ...] | None = None
    compile_backend: str = "inductor"  # torch.compile backend; tests use "aot_eager" to check tracing fast

    def buckets(self) -> tuple[int, ...]:
        if self.batch_buckets:
            return tuple(sorted(set(self.batch_buckets) | {self.max_batch}))
        sizes, n = [], 1
        while n < self.max_batch:
            sizes.append(n)
            n *= 2
        return (*sizes, self.max_batch)

    def lengths(self) -> tuple[int, ...]:
        if self.length_buckets:
            return tuple(sorted(set(self.length_buckets) | {self.max_len}))
        sizes, n = [], 128
        while n < self.max_len:
            sizes.append(n)
            n *= 2
        return (*sizes, self.max_len)
