"""Scheduler: which requests hold rows, and how much of each prompt a step prefills.

The Runtime's rounds run every row of a bucket; the scheduler decides what those rows are. A waiting
request takes the lowest free row once the cache memory it may write fits beside the running ones
(where rows are paged), and its prompt enters the caches whole when no row decodes, or, with a
per-step token budget (`RuntimeConfig.prefill_chunk`) while rows decode, in chunks that fit what the
budget leaves: running rows decode every step whatever joins.
"""

from __future__ import annotations

import heapq
from collections import deque

from dflow_rt.engine.lookup import NgramIndex
from dflow_rt.engine.request import Request

Work = list[tuple[list[Request], int]]  # (requests at the same prompt position, where their chunk ends)


class Scheduler:
    def __init__(self, max_batch: int, cache_budget: int | None, prefill_chunk: int | None, lookup: bool):
        self.rows: list[Request | None] = [None] * max_batch
        self.free_rows = list(range(max_batch))  # a heap: lowest rows first keeps buckets small
        self.waiting: deque[Request] = deque()
        self.cache_budget = cache_budget  # what rows may hold at once, where paged (None: dense rows)
        self.reserved = 0  # of it, what the requests holding rows may write
        self.prefill_chunk = prefill_chunk
        self.lookup = lookup
        self.prefill_tokens = 0  # prompt tokens the last `admit` scheduled

    def held(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    def admit(self) -> Work:
        """Waiting requests into free rows, then this step's prefill work: each admitted prompt whole
        (those at the same point together) while no row decodes, else at most `prefill_chunk` tokens in
        admission order, a prompt's chunks over as many steps as it takes."""
        while self.waiting and self.free_rows:
            req = self.waiting[0]
            if self.cache_budget is not None and self.reserved + req.need > self.cache_budget:
                break  # waits until finished rows give their memory back
            self.waiting.popleft()
            req.reserved, self.reserved = req.need, self.reserved + req.need
            req.row = heapq.heappop(self.free_rows)
            self.rows[req.row] = req
            req.text = NgramIndex(req.prompt.tolist()) if self.lookup else None
        held = self.held()
        filling = sorted((r for r in held if r.prefilled < r.prompt.numel()), key=lambda r: r.rid)
        budget = self.prefill_chunk if len(filling) < len(held) else None  # nobody to stall: whole prompts
        if budget is None:  # a prompt chunked while rows decoded goes on from where it stopped
            alike: dict[tuple[int, int], list[Request]] = {}
            for req in filling:
                alike.setdefault((req.prefilled, req.prompt.numel()), []).append(req)
            work = [(group, group[0].prompt.numel()) for group in alike.values()]
        else:
            work = []
            for req in filling:
                if budget == 0:
                    break
                take = min(budget, req.prompt.numel() - req.prefilled)
                work.append(([req], req.prefilled + take))
                budget -= take
        self.prefill_tokens = sum(len(group) * (end - group[0].prefilled) for group, end in work)
        return work

    def release(self, req: Request) -> int:
        """Take a finished request off its row and give back its memory: the row freed, or -1 when it
        held none (it was still waiting)."""
        self.reserved, req.reserved = self.reserved - req.reserved, 0
        row = req.row
        if row >= 0:
            heapq.heappush(self.free_rows, row)
            self.rows[row], req.row = None, -1
        return row
