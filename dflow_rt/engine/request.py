"""One request's record in a Runtime: what it asked for, where it runs, what it has emitted."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflow_rt.engine.lookup import NgramIndex


@dataclass
class Request:
    """Kept by the Runtime from `add_request` until `pop`: the row it holds while running, its tokens and
    per-round acceptance, and why it failed if it did."""

    rid: int
    prompt: torch.Tensor
    max_new_tokens: int
    stop: frozenset[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    row: int = -1
    position: int = 0  # absolute position of the next round's block slot 0 (the device's `start`)
    prefilled: int = 0  # prompt tokens in the caches: the request decodes once all are
    need: int = 0  # cache bytes it may write (prompt, answer, a block) where the caches are paged
    reserved: int = 0  # of `Runtime.cache_budget`, what it holds while it holds a row
    emitted: list[int] = field(default_factory=list)
    acceptance: list[int] = field(default_factory=list)  # tokens per round (accepted drafts + bonus)
    plain_steps: int = 0  # of those rounds, the ones in which the target stepped alone (`RuntimeConfig.ar_fallback`),
    #                       which emit one token each
    lookup_rounds: int = 0  # and the ones that verified the text's own continuation (`RuntimeConfig.lookup`)
    lookup_tokens: int = 0  # what those emitted
    text: NgramIndex | None = None  # prompt and output, where lookup rounds find their drafts
    finished: bool = False
    error: str | None = None  # why the request failed, if it did (it is also finished)
    delivered: int = 0  # tokens of `emitted` that `stream` has yielded: the rest wait here for it
