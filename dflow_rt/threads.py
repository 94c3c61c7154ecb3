"""CPU threads for decoding: the one default every command and job applies."""

from __future__ import annotations

import torch

from dflow_rt.errors import InputError

SMALL_TARGET = 50_000_000


def set_threads(threads: int | None, target) -> None:
    """`threads`, or by default 1 for a small target on CPU: its ops are too small to gain from
    splitting, and with a second thread every op waits for the slower core (decoding the bundled
    model drops from ~60 to ~2 tokens/s when another job holds one of two cores)."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise InputError(f"--threads must be an int of at least 1, got {threads!r}")
    if threads:
        torch.set_num_threads(threads)
    elif target.lm_head.weight.device.type == "cpu" and sum(p.numel() for p in target.parameters()) < SMALL_TARGET:
        torch.set_num_threads(1)
