"""`dflow_rt.generate`: one prompt through a fresh Runtime, start to end.

The Runtime reports a numerical fault in a request's row, so a request that goes wrong raises
`RequestError` here rather than decoding garbage; the batch-1 reference round
(`dflow_rt.reference.generate`) is the tests' oracle, not the way to decode.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from dflow_rt.config import RuntimeConfig
from dflow_rt.errors import RequestError
from dflow_rt.reference import GenerateOutput, request_length
from dflow_rt.requests import prompt_tensor
from dflow_rt.runtime import Runtime

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
