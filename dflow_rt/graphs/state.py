"""Everything the batched round reads or writes, preallocated once per Runtime.

Rows are request slots. A round touches every row of its batch bucket; rows without a live
request are padding whose results nobody reads, and whose `start` never moves.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dflow_rt.models.layers import KVCache
from dflow_rt.models.relay import VerifyRecord


@dataclass
class DecodeState:
    tokens: torch.Tensor       # [rows] block slot 0: the last token emitted (or about to be)
    start: torch.Tensor        # [rows] absolute position of block slot 0
    ctx_start: torch.Tensor    # [rows] position of last_verify.features[:, 0] (last verify's slot 0)
    fresh: torch.Tensor        # [rows] bool: slot 0 came from prefill and is not yet reported
    active: torch.Tensor       # [rows] bool: a live request owns the row
    temperature: torch.Tensor  # [rows] float32; 0 = greedy
    top_k: torch.Tensor        # [rows] long; 0 = off
    top_p: torch.Tensor        # [rows] float32; 1 = off
    seed: torch.Tensor         # [rows] long
    faulted: torch.Tensor      # [rows] bool: a NaN/inf logit since the row was last cleaned
    out: torch.Tensor          # [rows, B + 3] long: count, the tokens emitted this round, then `faulted`
    lookup: torch.Tensor       # [rows, B - 1] long: a lookup round's drafts, written by the host (engine/lookup.py)
    slots: torch.Tensor        # [B] arange, kept to avoid a per-round allocation
    target_cache: KVCache
    draft_cache: KVCache | None
    last_verify: VerifyRecord | None  # each row's last verify pass: the next context and the relay

    @classmethod
    def allocate(cls, target, drafter, rows: int, max_len: int, block_size: int) -> DecodeState:
        dev = target.lm_head.weight.device

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=dev)

        return cls(
            tokens=zeros(rows), start=zeros(rows), ctx_start=zeros(rows), fresh=zeros(rows, dtype=torch.bool),
            active=zeros(rows, dtype=torch.bool), temperature=zeros(rows, dtype=torch.float32), top_k=zeros(rows),
            top_p=torch.ones(rows, device=dev), seed=zeros(rows), faulted=zeros(rows, dtype=torch.bool),
            out=zeros(rows, block_size + 3), lookup=zeros(rows, block_size - 1),
            slots=torch.arange(block_size, device=dev), target_cache=target.new_cache(rows, max_len),
            draft_cache=drafter.new_cache(rows, max_len) if drafter is not None else None,
            last_verify=drafter.new_verify_record(rows, block_size) if drafter is not None else None,
        )

    def view(self, n: int, length: int | None = None) -> DecodeState:
        """The first `n` rows, and caches cut to `length` positions, sharing storage: the
        state of one (batch, length) bucket."""
        parts = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "slots" or value is None:
                parts[f.name] = value
            elif isinstance(value, torch.Tensor):
                parts[f.name] = value[:n]
            else:
                parts[f.name] = value.view(n, length) if isinstance(value, KVCache) else value.view(n)
        return DecodeState(**parts)

    def park(self, row: int) -> None:
        """Make `row` padding until a request reuses it: inactive, greedy (padding must not keep rounds
        on the sampling path), at position 0, where its block always fits the cache (its last round
        may have left `start` within B of max_len)."""
        for t in (self.active, self.temperature, self.start, self.ctx_start):
            t[row] = 0

    def release(self, row: int, zero: bool = False) -> None:
        """Give back the cache memory `row` holds where the caches are paged (`models.cache_pages`); with
        `zero`, its entries are zeros afterwards in any case."""
        for cache in (self.target_cache, self.draft_cache):
            if cache is not None:
                cache.release(row, zero)

    def clean(self, row: int) -> None:
        """Zero every cache entry and verify record of `row` and park it.

        Masks do not contain a NaN or inf left by a failed request: attention multiplies masked
        keys and values by zero weights, and 0 * NaN is NaN. A row is cleaned when it faults,
        before any request can reuse it."""
        self.release(row, zero=True)  # paged: given back, reading zeros; else zeroed
        if self.last_verify is not None:
            for t in self.last_verify.tensors():
                t[row] = 0
            self.last_verify.clear(torch.tensor([row], device=self.tokens.device))
        for t in (self.tokens, self.fresh, self.faulted):
            t[row] = 0
        self.park(row)

    def caches(self) -> list[torch.Tensor]:
        """The key/value tensors, whose length axis (2) varies across length buckets."""
        return [t for c in (self.target_cache, self.draft_cache) if c is not None for t in c.tensors()]

    def tensors(self) -> list[torch.Tensor]:
        """Every persistent buffer (for checks that storage never moves)."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif value is not None:
                out += value.tensors()
        return out
