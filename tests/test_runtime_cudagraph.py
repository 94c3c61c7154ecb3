"""The `cudagraph` Runtime mode (rounds compiled and captured as CUDA graphs, replayed each step)
emits exactly the tokens of the eager Runtime and of the reference round, greedy and sampled, with
requests joining and leaving rows between replays. CUDA only: elsewhere every test here is skipped.

The reference fixture's models are loaded afresh onto the GPU (the pair the other tests share stays on the CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

import dflow_rt.oracle
from dflow_rt.engine.runtime import Runtime
from tests.conftest import FIXTURES, load_pair
from tests.helpers import fixed, random_relay

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the cudagraph mode captures CUDA graphs")

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]
PROMPTS = [c["prompt_ids"] for c in CASES]
DEV = "cuda"


@pytest.fixture(scope="module")
def pair():
    return tuple(m.to(DEV) for m in load_pair(FIXTURES))


def cudagraph(**kw):
    """Rounds captured as CUDA graphs; torch.compile's aot_eager traces them quickly unless told
    otherwise, and nothing is written to the compile cache."""
    return fixed(**{"mode": "cudagraph", "compiler": "aot_eager", "compile_cache": False, **kw})


def per_round(rt: Runtime, prompts, max_new_tokens, **kw):
    """Run to completion; per request its tokens and the token count of every step."""
    rids = [rt.add_request(p, max_new_tokens=max_new_tokens, **kw) for p in prompts]
    counts = {r: [] for r in rids}
    while not all(rt.is_finished(r) for r in rids):
        for rid, toks in rt.step().items():
            counts[rid].append(len(toks))
    return [rt.pop(r).emitted for r in rids], [counts[r] for r in rids]


def reference_counts(out):
    """Tokens per step as the Runtime reports them: the first step also carries prefill's token."""
    counts = list(out.acceptance_lengths)
    counts[0] += 1
    counts[-1] -= sum(counts) - len(out.token_ids)  # the last round may be cut by max_new_tokens
    return counts


def record_buckets(rt: Runtime) -> set:
    """The (rows, length, greedy, width) buckets that `rt`'s steps replay from now on."""
    used = set()
    rt.rounds = {key: (lambda key=key, run=run: (used.add(key), run())) for key, run in rt.rounds.items()}
    return used


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("emit", [True, False], ids=["public-round", "mask-excluded"])
def test_cudagraph_matches_the_reference_round(pair, kernels, emit):
    """Eight requests through four rows (rows are reused as requests finish), over several batch and
    length buckets: every request's tokens and per-round acceptances are the reference round's, and
    with the public round's rule (`emit_mask_token`) the DFlash reference implementation's tokens."""
    target, drafter = pair
    rt = Runtime(target, drafter, cudagraph(max_batch=4, max_len=160, length_buckets=(48, 80, 112),
                                            emit_mask_token=emit, kernels=kernels))
    used = record_buckets(rt)
    outs, counts = per_round(rt, PROMPTS, 64)
    assert len({key[0] for key in used}) >= 2 and len({key[1] for key in used}) >= 2, used
    for case, out, cnt in zip(CASES, outs, counts, strict=True):
        ref = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], 64, config=fixed(emit_mask_token=emit))
        assert out == ref.token_ids and cnt == reference_counts(ref)
        if emit:
            assert out == case["output_ids"]


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_cudagraph_samples_as_eager(pair, kernels):
    """Greedy and sampled rows in one captured round (temperature, top-k, top-p, per-request seeds):
    the eager Runtime's tokens, request for request, with a DFlow drafter's relay in the graph."""
    target, parent = pair
    drafter = random_relay(parent, seed=3).to(DEV)
    kws = [{}, {"temperature": 1.0, "seed": 5}, {"temperature": 0.8, "top_k": 4, "seed": 6},
           {"temperature": 1.2, "top_p": 0.9, "seed": 7}, {}, {"temperature": 0.7, "top_k": 3, "top_p": 0.8, "seed": 8}]
    runs = []
    for config in (cudagraph(max_batch=4, max_len=160, kernels=kernels), fixed(max_batch=4, max_len=160,
                                                                                kernels=kernels)):
        rt = Runtime(target, drafter, config)
        rids = [rt.add_request(p, max_new_tokens=40, **kw) for p, kw in zip(PROMPTS, kws, strict=False)]
        while not all(rt.is_finished(r) for r in rids):
            rt.step()
        runs.append([(rt.requests[r].emitted, rt.requests[r].acceptance) for r in rids])
    captured, eager = runs
    assert captured == eager
    greedy = dflow_rt.oracle.generate(target, drafter, PROMPTS[0], 40, config=fixed())
    assert captured[0] == (greedy.token_ids, greedy.acceptance_lengths)


def test_inductor_cudagraph_matches_the_reference_round(pair):
    """The production path: inductor-compiled rounds captured as CUDA graphs, default kernels."""
    target, drafter = pair
    rt = Runtime(target, drafter, cudagraph(max_batch=2, max_len=160, compiler="inductor"))
    outs, counts = per_round(rt, PROMPTS[:4], 48)
    for prompt, out, cnt in zip(PROMPTS[:4], outs, counts, strict=True):
        ref = dflow_rt.oracle.generate(target, drafter, prompt, 48, config=fixed())
        assert out == ref.token_ids and cnt == reference_counts(ref)
    sampled = {"max_new_tokens": 32, "temperature": 1.0, "top_p": 0.9, "seed": 2}
    eager = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
    assert rt.generate(PROMPTS[:3], **sampled) == eager.generate(PROMPTS[:3], **sampled)
