"""The KV cache's memory on Linux CPUs: reserved whole, resident only where written, given back per row.

A Runtime's caches are dense, `max_batch x max_len` positions a layer, so that every round has
static shapes. Reserved with `torch.zeros` they are resident from the start: 64 rows of 8,192
positions of SmolLM2 would take 24 GB whatever the requests hold. Here each cache tensor is an
anonymous mapping instead (`MAP_NORESERVE`: the reservation is address space, not memory) whose
pages the kernel supplies as zeros on first write and maps to its one shared zero page on read,
so a row costs the pages its positions were written to. When a request ends, `Cache.release`
gives that row's pages back (`MADV_DONTNEED`: they read as zeros again). Huge pages are advised
off for these mappings, where one write would take 2 MB. This is the OS's page table standing in
for a paged cache's block table: the shapes stay static (compiled rounds, the C++ attention and
torch's read the same tensors), and the Runtime's admission bounds what rows may write
(`engine.limits`). On other devices and off Linux, `torch.zeros`. `DFLOW_RT_CACHE_PAGES=0` keeps
every cache resident (a debugging switch).
"""

from __future__ import annotations

import math
import mmap
import os

import torch

NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python names it from 3.12


def available(device: torch.device | str) -> bool:
    return (torch.device(device).type == "cpu" and hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap, "MAP_ANONYMOUS")
            and os.environ.get("DFLOW_RT_CACHE_PAGES", "1") != "0")


class Cache:
    """A zero tensor of `shape` (rows first) whose pages are resident only once written (on a Linux
    CPU; elsewhere an ordinary `torch.zeros`)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str):
        self.region = None
        if not available(device):
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
            return
        item = torch.empty((), dtype=dtype).element_size()
        row = math.prod(shape[1:])
        self.row_bytes = -(-row * item // mmap.PAGESIZE) * mmap.PAGESIZE  # rows start on pages: `release` is exact
        self.region = mmap.mmap(-1, max(shape[0] * self.row_bytes, 1),
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | NORESERVE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self.region.madvise(mmap.MADV_NOHUGEPAGE)
        rows = torch.frombuffer(self.region, dtype=torch.uint8).view(dtype).view(shape[0], self.row_bytes // item)
        self.tensor = rows[:, :row].view(shape)  # strided by whole pages along the rows, contiguous within

    def release(self, row: int, zero: bool = False) -> None:
        """Give back the pages of row `row`: they read as zeros again. Where the tensor is an ordinary
        one, nothing to give back: zeroed if `zero`, else left as it is."""
        if self.region is not None:
            self.region.madvise(mmap.MADV_DONTNEED, row * self.row_bytes, self.row_bytes)
        elif zero:
            self.tensor[row].zero_()
