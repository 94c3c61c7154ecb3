"""The models' weights in transparent huge pages on Linux CPUs.

A batch-1 step reads every weight once, streaming hundreds of megabytes. In 4 KB pages that
stream needs a page-table walk every 4 KB, and the hardware prefetcher stops at each page
boundary. In 2 MB pages one SmolLM2 step's products ran 1.10-1.25x faster at one row and 1.05x at
four on a Zen 4 EPYC (docs/experiments.md). torch allocates in ordinary pages unless asked when
the process starts (`THP_MEM_ALLOC_ENABLE`), so the Runtime moves the weights itself. It copies
them into one anonymous mapping, advised `MADV_HUGEPAGE`, and points each parameter there. Values,
parameter objects and ties between models stay as they were. Where the kernel grants no huge
pages, the mapping is an ordinary one. `DFLOW_RT_HUGE_PAGES=0` turns this off.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch
from torch import nn

log = logging.getLogger("dflow_rt")
HUGE = 2 << 20  # the x86-64 and arm64 transparent huge page
MIN_BYTES = 64 << 20  # smaller models fit the TLB's reach, or nearly: not worth a copy
_MOVED = "_dflow_rt_huge_pages"  # set on a model whose weights were placed


def placed(model: nn.Module) -> bool:
    """Whether `place` has dealt with `model` (or was told to leave it: `settle`)."""
    return getattr(model, _MOVED, False)


def settle(model: nn.Module) -> None:
    """Mark `model` as placed: `place` leaves it where it is (a model holding weights as codes, whose
    placeholders it would copy out to full size)."""
    object.__setattr__(model, _MOVED, True)


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("DFLOW_RT_HUGE_PAGES", "1") != "0"


def place(*models: nn.Module | None, min_bytes: int = MIN_BYTES) -> bool:
    """Move the CPU parameters of `models` (shared ones once) into huge pages; True if moved.
    A no-op for models already placed, on other devices, below `min_bytes`, or off Linux."""
    models = tuple(m for m in models if m is not None and not placed(m))
    params = list({id(p): p for m in models for p in m.parameters() if p.device.type == "cpu"}.values())
    total = sum(_padded(p) for p in params)
    if not available() or not params or total < min_bytes:
        return False
    try:
        region = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as err:  # no THP support: the weights stay where they are
        log.warning("huge pages unavailable (%s); weights stay in ordinary pages", err)
        return False
    raw = torch.frombuffer(region, dtype=torch.uint8)  # each view keeps the mapping alive
    at = (-raw.data_ptr()) % HUGE  # the first 2 MB boundary: huge pages cover aligned 2 MB spans
    with torch.no_grad():
        for p in params:
            n = p.numel() * p.element_size()
            view = raw[at:at + n].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view  # the old storage is freed here, so the peak stays near one copy plus the mapping
            at += _padded(p)
    for m in models:
        settle(m)
    return True


def _padded(p: torch.Tensor) -> int:
    """Bytes `p` takes in the mapping: rounded up to 64, so that every weight starts on a cache line."""
    return -(-p.numel() * p.element_size() // 64) * 64
