"""The decoders `bench --suite e2e` compares, each wrapped as a runner with one timing contract.

A runner decodes a group of prompts (one prompt, or one batch of them) greedily and reports
what a user of that decoder sees: the tokens (cut at the first stop token), the tokens each
round emitted, the time to the first emitted tokens, and how many tokens came after them in
how much time. Every decoder is timed the same way, so their tokens/s and TTFT compare:
decode tokens/s = tokens after the first emission / time after the first emission.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from dflow_rt.config import RuntimeConfig
from dflow_rt.engine.runtime import Runtime
from dflow_rt.oracle import generate


@dataclass
class Run:
    """One call of a runner: per prompt its tokens and per-round acceptance, and the group's timing."""

    outputs: list[list[int]]
    acceptance: list[list[int]]  # tokens emitted per round, per prompt (the bonus token counted)
    ttft_s: float  # from the call to the first emitted tokens
    decode_tokens: int  # tokens emitted after the first emission, all prompts of the group together
    decode_s: float  # time after the first emission


Runner = Callable[[list[list[int]], int], Run]  # (prompts of one group, max_new_tokens) -> Run


def runtime_runner(target, drafter, config: RuntimeConfig, stops: Sequence[int]) -> Runner:
    """A Runtime of `config` (one batch bucket: its max_batch), built (and compiled) now, so that
    building is never timed; a call admits its prompts together, as a server would admit a full batch."""
    config = replace(config, batch_buckets=(config.max_batch,), tuned=False, sampling=False)  # greedy runs
    rt = Runtime(target, drafter, config)

    def run(prompts: list[list[int]], max_new: int) -> Run:
        t0 = time.perf_counter()
        rids = [rt.add_request(p, max_new_tokens=max_new, stop_token_ids=stops) for p in prompts]
        first = sum(len(tokens) for tokens in rt.step().values())  # prefill and the first round
        t1 = time.perf_counter()
        while not all(rt.is_finished(r) for r in rids):
            rt.step()
        t2 = time.perf_counter()
        reqs = [rt.pop(r) for r in rids]
        return Run([r.emitted for r in reqs], [r.acceptance for r in reqs], t1 - t0,
                   sum(len(r.emitted) for r in reqs) - first, t2 - t1)

    return run


def reference_runner(target, drafter, stops: Sequence[int]) -> Runner:
    """`dflow_rt.oracle.generate`, the batch-1 reference round: its first token comes from prefill."""

    def run(prompts: list[list[int]], max_new: int) -> Run:
        (prompt,) = prompts
        t0 = time.perf_counter()
        out = generate(target, drafter, prompt, max_new_tokens=max_new, stop_token_ids=stops)
        wall = time.perf_counter() - t0
        return Run([out.token_ids], [out.acceptance_lengths], wall - out.decode_seconds, len(out.token_ids) - 1,
                   out.decode_seconds)

    return run


def hf_runner(model, stops: Sequence[int], prompt_lookup: int | None = None) -> Runner:
    """transformers `generate()`, greedy with its KV cache; `prompt_lookup` candidates per round
    turn on prompt-lookup assisted generation. A streamer timestamps every emission: its sizes
    are the rounds' acceptance lengths, its first one after the prompt is the first token."""
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.sizes: list[int] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())
            self.sizes.append(value.numel())

        def end(self) -> None:
            pass

    device = model.device

    def run(prompts: list[list[int]], max_new: int) -> Run:
        (prompt,) = prompts
        ids = torch.tensor([prompt], device=device)
        config = GenerationConfig(max_new_tokens=max_new, do_sample=False, num_beams=1, use_cache=True,
                                  eos_token_id=list(stops) or None, pad_token_id=stops[0] if stops else 0,
                                  prompt_lookup_num_tokens=prompt_lookup)
        clock = Clock()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=clock)
        t2 = time.perf_counter()
        tokens = out[0, ids.shape[1]:].tolist()  # up to and including a stop token, as ours
        times, sizes = clock.times[1:], clock.sizes[1:]  # the first put is the prompt
        return Run([tokens], [sizes], times[0] - t0, len(tokens) - sizes[0], t2 - times[0])

    return run
