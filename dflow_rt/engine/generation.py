"""`dflow_rt.generate`: one prompt through a fresh Runtime, start to end.

The Runtime reports a numerical fault in a request's row, so a request that goes wrong raises
`RequestError` here rather than decoding garbage; the batch-1 reference round
(`dflow_rt.oracle.generate`) is the tests' oracle, not the way to decode.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflow_rt.checks import check_fits, check_int, prompt_tensor
from dflow_rt.config import RuntimeConfig
from dflow_rt.engine.runtime import Runtime
from dflow_rt.errors import RequestError
from dflow_rt.models.drafter import Drafter
from dflow_rt.models.target import Target


@dataclass
class GenerateOutput:
    """One request's tokens and timings, from `dflow_rt.generate` (a Runtime) or the reference round."""

    token_ids: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    first_step_seconds: float = 0.0  # prefill (the reference); prefill and the first round (a Runtime)
    decode_seconds: float = 0.0  # every later round
    first_step_tokens: int = 1  # tokens the first step emitted
    plain_steps: int = 0  # rounds without drafting (a Runtime's `ar_fallback`): a 1 each in acceptance_lengths
    lookup_rounds: int = 0  # rounds that verified the text's own continuation (a Runtime's `lookup`)
    lookup_tokens: int = 0  # what those emitted, within acceptance_lengths

    @property
    def tau(self) -> float:
        """Mean acceptance length per round the drafter drafted, counting the bonus token (plain
        steps and lookup rounds are taken out)."""
        drafted = len(self.acceptance_lengths) - self.plain_steps - self.lookup_rounds
        emitted = sum(self.acceptance_lengths) - self.plain_steps - self.lookup_tokens
        return emitted / drafted if drafted > 0 else 1.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first step per second of the later rounds."""
        return (len(self.token_ids) - self.first_step_tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0


def request_length(target: Target, drafter: Drafter | None, config: RuntimeConfig | None, prompt_len: int,
                   max_new_tokens: int) -> tuple[int, int]:
    """(block size B, positions one request needs: prompt + new tokens + one block), after checking
    them against `config.max_len` (default: the target's max_position_embeddings)."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    B = 1 if drafter is None else check_int("block_size", (config and config.block_size) or drafter.block_size, 1)
    limit = target.config.max_position_embeddings if config is None else config.max_len
    check_fits(prompt_len, max_new_tokens, B, limit)
    return B, prompt_len + max_new_tokens + B


# Eager rounds start at once, which suits one call; verifying the whole block matches the reference round.
ONE_REQUEST = RuntimeConfig(max_batch=1, mode="eager", verify_width=None)


def generate(target, drafter, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int = 64,
             stop_token_ids: Sequence[int] | None = None, config: RuntimeConfig | None = None,
             **sampling) -> GenerateOutput:
    """The new tokens of `prompt_ids` (up to `max_new_tokens`, or to the first stop token, included),
    with per-round acceptance lengths and timings.

    `config`: the Runtime's settings (default `ONE_REQUEST`; `mode="compile"` compiles the rounds
    once per shape, then loads them from the disk cache); its max_len bounds prompt + new tokens +
    block (default: the target's max_position_embeddings) and the Runtime is sized to this one
    request. `sampling`: temperature, top_k, top_p, seed, as `Runtime.add_request` takes them
    (default greedy). A fault in the request's logits raises `RequestError`.
    """
    prompt = prompt_tensor(prompt_ids, target.config.vocab_size, target.lm_head.weight.device)[0]
    _, length = request_length(target, drafter, config, prompt.numel(), max_new_tokens)
    sized = dataclasses.replace(config or ONE_REQUEST, max_batch=1, batch_buckets=None, max_len=length)
    return run_one(Runtime(target, drafter, sized), prompt, max_new_tokens, stop_token_ids or (), **sampling)


def run_one(rt: Runtime, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
            stop_token_ids: Sequence[int] = (), **sampling) -> GenerateOutput:
    """One request through `rt`, stepped until it finishes: the first step (prefill, whose token the
    first round reports with its own) timed apart from the later rounds."""
    t0 = time.perf_counter()
    rid = rt.add_request(prompt_ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, **sampling)
    first = len(rt.step().get(rid, ()))
    t1 = time.perf_counter()
    while not rt.is_finished(rid):
        rt.step()
    t2 = time.perf_counter()
    req = rt.pop(rid)
    if req.error is not None:
        raise RequestError(rid, req.error)
    return GenerateOutput(req.emitted, req.acceptance, t1 - t0, t2 - t1, first, req.plain_steps, req.lookup_rounds,
                          req.lookup_tokens)
