"""Lookup rounds: drafts from the text's own past, where a row's last tokens occurred before
(`dflow_rt.engine.lookup`). The index against a brute-force search, and the rounds lossless and keeping the
drafter's context as plain steps do."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dflow_rt
import dflow_rt.oracle
from dflow_rt.config import RuntimeConfig
from dflow_rt.engine.lookup import N, NgramIndex
from dflow_rt.engine.policy import LOOKUP_RETRY, PROBE, WINDOW, RoundPolicy
from dflow_rt.engine.runtime import Runtime
from tests.helpers import fixed, random_relay, scheduled_runtime
from tests.test_runtime import CASES, record_buckets


def brute_force(text: list[int], count: int) -> list[int]:
    """What followed the last N tokens of `text` at their latest earlier occurrence."""
    key = text[-N:]
    for j in range(len(text) - N - 1, -1, -1):
        if len(key) == N and text[j:j + N] == key:
            return text[j + N:j + N + count]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=12), st.integers(1, 6))
def test_drafts_are_the_latest_continuation(prompt, emitted, count):
    index = NgramIndex(prompt)
    for t in emitted:  # as rounds report them, a token at a time or several
        assert index.drafts(count) == brute_force(index.tokens, count)
        index.extend([t])
    assert index.tokens == prompt + emitted and index.drafts(count) == brute_force(prompt + emitted, count)


def repeating_prompts(target, drafter) -> list[list[int]]:
    """Prompts whose continuation repeats text the prompt holds: each case's prompt, its greedy
    output, the prompt again (so lookup finds drafts the target accepts)."""
    out = []
    for c in CASES[:3]:
        done = dflow_rt.oracle.generate(target, drafter, c["prompt_ids"], 24, config=fixed(emit_mask_token=True))
        out.append(c["prompt_ids"] + done.token_ids + c["prompt_ids"])
    return out


@pytest.mark.parametrize("relay", [False, True], ids=["dflash", "dflow"])
def test_lookup_rounds_between_drafted_rounds_are_lossless(reference_pair, relay):
    target, drafter = reference_pair
    drafter = random_relay(drafter, seed=1) if relay else drafter
    rt = scheduled_runtime(target, drafter, lambda i, widths: widths[-1] if i % 4 == 3 else 1,
                           emit_mask_token=True, lookup=True)
    rt.policy.lookup = lambda rows, width: width == 1  # drafted rounds between them
    used = record_buckets(rt)
    prompts = repeating_prompts(target, drafter)
    rids = [rt.add_request(p, max_new_tokens=40) for p in prompts]
    while not all(rt.is_finished(r) for r in rids):
        rt.step()
    for prompt, rid in zip(prompts, rids, strict=True):
        req = rt.pop(rid)
        ref = dflow_rt.oracle.generate(target, drafter, prompt, 40, config=fixed(emit_mask_token=True))
        assert req.emitted == ref.token_ids
        assert req.lookup_rounds > 0 and req.lookup_tokens > req.lookup_rounds  # drafts found, and accepted
    assert {key[3:] for key in used} == {(1, False), (drafter.block_size, False), (drafter.block_size, True)}


def test_lookup_rounds_keep_the_drafters_context(reference_pair):
    """After m rounds that are plain steps or lookup rounds, the drafted rounds accept what a Runtime
    that prefilled the prompt and the tokens so far accepts: lookup rounds, which commit up to k
    tokens, leave the drafter every committed token's features, as plain steps do."""
    target, drafter = reference_pair
    prompt, m = repeating_prompts(target, drafter)[0], 6
    rt = scheduled_runtime(target, drafter, lambda i, widths: widths[-1] if i >= m else 1, emit_mask_token=True,
                           lookup=True)
    rt.policy.lookup = lambda rows, width: width == 1  # lookup rounds among the first m only
    rid = rt.add_request(prompt, max_new_tokens=40)
    while not rt.is_finished(rid):
        rt.step()
    stepped = rt.pop(rid)
    assert stepped.lookup_rounds > 0 and stepped.lookup_rounds + stepped.plain_steps == m
    done = sum(stepped.acceptance[:m]) + 1  # tokens emitted by then (+1: prefill's)
    fresh = Runtime(target, drafter, RuntimeConfig(max_batch=1, max_len=160, mode="eager", verify_width=None,
                                                   emit_mask_token=True))
    rid = fresh.add_request(prompt + stepped.emitted[:done - 1], max_new_tokens=40 - done + 1)
    while not fresh.is_finished(rid):
        fresh.step()
    again = fresh.pop(rid)
    assert again.emitted == stepped.emitted[done - 1:] and again.acceptance == stepped.acceptance[m:]


def test_lookup_rounds_serve_greedy_and_sampled_rows_losslessly_and_are_off_on_request(reference_pair):
    """A looked-up token is a point-mass draft, as the drafter's argmax is: the sampled verify accepts
    it while the target's own draw agrees, so a sampled row decodes what plain sampling with its seed
    decodes."""
    target, drafter = reference_pair
    settings = dict(max_batch=1, max_len=160, mode="compile", compiler="aot_eager", length_buckets=(64,),
                    verify_width=2, ar_fallback=True, emit_mask_token=True)
    rt = Runtime(target, drafter, RuntimeConfig(**settings))
    lookups = [key for key in rt.rounds if key[4]]
    assert {key[2] for key in lookups} == {True, False} and all(key[3] == rt.plan.widths[key[0]] for key in lookups)
    prompt = repeating_prompts(target, drafter)[0]
    for policy in (rt.policy, rt.sampled_policy):
        policy.width, policy.lookup = (lambda rows: 1), (lambda rows, width: True)
    plain = Runtime(target, None, RuntimeConfig(max_batch=1, max_len=160, mode="eager"))

    def run(runtime, **sampling):
        rid = runtime.add_request(prompt, max_new_tokens=30, **sampling)
        while not runtime.is_finished(rid):
            runtime.step()
        return runtime.pop(rid)

    greedy = run(rt)
    assert greedy.lookup_rounds > 0 and greedy.emitted == run(plain).emitted
    looked_up = 0
    for seed in (3, 4, 5, 6):
        sampled = run(rt, temperature=0.4, seed=seed)
        assert sampled.emitted == run(plain, temperature=0.4, seed=seed).emitted
        looked_up += sampled.lookup_rounds
    assert looked_up > 0
    off = Runtime(target, drafter, RuntimeConfig(**{**settings, "mode": "eager", "lookup": False}))  # same keys
    assert not off.plan.lookup and not any(key[4] for key in off.rounds)


def test_lookup_rounds_run_while_their_rate_beats_the_width_they_replace():
    fallback = RoundPolicy({1: (1, 2, 4)})
    assert fallback.lookup(1, 1)  # nothing timed yet
    for _ in range(5):
        fallback.record(1, 1, 0.010, [1])  # plain steps: 100 tokens/s
    for _ in range(PROBE):
        fallback.record_lookup(1, 0.020, [3])  # 150 tokens/s
    assert all(fallback.lookup(1, 1) for _ in range(3 * LOOKUP_RETRY))
    for _ in range(WINDOW):  # the whole window of lookup timings
        fallback.record_lookup(1, 0.020, [1.5])  # 75 tokens/s: plain steps win
    chances = [fallback.lookup(1, 1) for _ in range(15 * LOOKUP_RETRY)]  # retries back off while they lose
    assert [i for i, c in enumerate(chances) if c] == [LOOKUP_RETRY - 1, 3 * LOOKUP_RETRY - 1, 7 * LOOKUP_RETRY - 1,
                                                       15 * LOOKUP_RETRY - 1]
    for _ in range(WINDOW):
        fallback.record_lookup(1, 0.010, [1.5])  # 150 tokens/s again
    assert fallback.lookup(1, 1) and fallback.lookup(1, 2)  # faster than plain steps; width 2 not timed yet
    assert fallback.buckets[1].lookup_interval == LOOKUP_RETRY  # and the next losing stretch backs off anew
