"""The fallback's choice of verify width (width 1: the target steps alone) from timings, and the
rounds it runs (lossless, and a plain step keeps the drafter's context, so drafting resumes where it
would have been)."""

import json

import pytest

import dflow_rt
import dflow_rt.oracle
from dflow_rt.config import RuntimeConfig
from dflow_rt.engine.policy import FIRST_RETRY, LONGEST_RETRY, PROBE, RECHECK, RoundPolicy
from dflow_rt.engine.runtime import Runtime
from tests.helpers import fixed, random_relay, scheduled_runtime
from tests.test_runtime import CASES, record_buckets


def choices(widths: tuple[int, ...], rounds: int, seconds: dict[int, float], accepted) -> list[int]:
    """The widths a fallback over `widths` runs for `rounds` rounds of one bucket whose rounds at
    width w take `seconds[w]` and whose block at round i has `accepted(i)` drafts the target accepts
    (so a round at width w emits min(accepted(i) + 1, w) tokens)."""
    policy, out = RoundPolicy({1: widths}), []
    for i in range(rounds):
        w = policy.width(1)
        policy.record(1, w, seconds[w], [min(accepted(i) + 1, w)])
        out.append(w)
    return out


def gaps(widths: list[int]) -> list[int]:
    """Lengths of the runs of plain steps between drafted rounds."""
    runs, n = [], 0
    for w in widths:
        if w > 1:
            if n:
                runs.append(n)
            n = 0
        else:
            n += 1
    return runs


K2 = {1: 0.020, 2: 0.031}  # a plain step, and a round at width 2


def test_plain_steps_take_over_when_drafting_loses_and_retries_back_off():
    """tau 1.25 in 31 ms against one token in 20 ms: 40.3 against 50 tokens/s (a retry's two rounds
    make at most 1.5 tokens each: 48.4)."""
    kinds = choices((1, 2), 4000, K2, lambda i: int(i % 4 == 0))
    assert kinds[:3] == [2] * 3 and kinds[3:3 + PROBE] == [1] * PROBE
    assert gaps(kinds)[:6] == [PROBE + FIRST_RETRY, 2 * FIRST_RETRY, 4 * FIRST_RETRY, 8 * FIRST_RETRY, 16 * FIRST_RETRY,
                               LONGEST_RETRY]
    assert kinds[1000:].count(2) / 3000 < 0.01


def test_drafting_stays_while_it_pays_with_a_plain_timing_now_and_then():
    """tau 2 in 31 ms against one token in 20 ms."""
    kinds = choices((1, 2), 3000, K2, lambda i: 1)
    assert set(gaps(kinds[10:])) == {PROBE}
    assert kinds.count(1) <= PROBE * (len(kinds) // RECHECK + 2)


def test_a_drafter_that_stops_paying_is_dropped_without_a_probe_and_retried():
    """tau falls from 2 to 1 at round 1000: the window's mean (32 rounds) passes 1.48 (the break-even,
    less the 5 % margin) within 17 drafted rounds; plain steps follow until the first retry."""
    kinds = choices((1, 2), 1500, K2, lambda i: int(i < 1000))
    assert set(gaps(kinds[600:1000])) <= {PROBE}
    first_plain = next(i for i in range(1000, 1500) if 2 not in kinds[i:i + FIRST_RETRY])
    assert first_plain <= 1000 + 17 + PROBE and kinds[first_plain + FIRST_RETRY] == 2


def test_a_retry_on_easier_text_brings_drafting_back():
    """tau 1 until round 300, then 2: the first retry after that drafts again for good, although the
    window of drafted rounds still held the weak stretch's rounds when plain steps took over."""
    kinds = choices((1, 2), 1000, K2, lambda i: int(i >= 300))
    assert kinds[:300].count(2) < 20  # plain steps, but for the backed-off retries
    back = next(i for i in range(300, 1000) if kinds[i] == 2)
    assert set(gaps(kinds[back:])) <= {PROBE} and kinds[back:].count(2) > 0.95 * (1000 - back)


K4 = {1: 0.020, 2: 0.024, 4: 0.028}  # rounds at widths 1, 2 and 4


@pytest.mark.parametrize(("accepted", "best"), [(3, 4), (1, 2), (0, 1)])
def test_the_width_of_the_highest_rate_runs(accepted, best):
    """Every block has `accepted` drafts the target takes: 4 tokens in 28 ms (143/s) beat 2 in 24 ms;
    with one accepted draft, 2 in 24 ms (83/s) beat the same 2 in 28 ms; with none, plain steps win.
    The widest runs first, and its rounds show what the narrower widths would emit."""
    kinds = choices((1, 2, 4), 2000, K4, lambda i: accepted)
    assert kinds[:3] == [4] * 3 and sorted(kinds[3:3 + 2 * PROBE]) == [1] * PROBE + [2] * PROBE
    settled = kinds[100:]
    assert settled.count(best) > 0.97 * len(settled)


def test_a_wider_width_is_taken_up_at_the_next_probe_when_the_text_gets_easier():
    """One accepted draft a block (width 2 best) until round 500, then three (width 4 best): the next
    probe of width 4 shows it, and width 4 runs from then on."""
    kinds = choices((1, 2, 4), 1500, K4, lambda i: 1 if i < 500 else 3)
    assert kinds[100:500].count(2) > 0.97 * 400
    up = next(i for i in range(500, 1500) if kinds[i:i + 10] == [4] * 10)
    assert up <= 500 + RECHECK + 4 * PROBE and kinds[up + 20:].count(4) > 0.97 * len(kinds[up + 20:])


@pytest.mark.parametrize("relay", [False, True], ids=["dflash", "dflow"])
def test_plain_steps_between_drafted_rounds_are_lossless(reference_pair, relay):
    target, drafter = reference_pair
    drafter = random_relay(drafter, seed=1) if relay else drafter
    rt = scheduled_runtime(target, drafter, lambda i, widths: widths[i % 5 % len(widths)], emit_mask_token=True)
    used = record_buckets(rt)
    prompts = [c["prompt_ids"] for c in CASES[:3]]
    outs = rt.generate(prompts, max_new_tokens=48)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = dflow_rt.oracle.generate(target, drafter, prompt, 48, config=fixed(emit_mask_token=True))
        assert out == ref.token_ids
    assert {key[3] for key in used} == {1, (drafter.block_size + 1) // 2, drafter.block_size}


def test_plain_steps_keep_the_drafters_context(reference_pair):
    """After m plain steps, the drafted rounds accept what a Runtime that prefilled the prompt and
    those m tokens accepts: the plain steps wrote every committed token's features to the drafter."""
    target, drafter = reference_pair
    prompt, m = CASES[0]["prompt_ids"], 7
    rt = scheduled_runtime(target, drafter, lambda i, widths: widths[-1] if i >= m else 1, emit_mask_token=True)
    rid = rt.add_request(prompt, max_new_tokens=40)
    while not rt.is_finished(rid):
        rt.step()
    stepped = rt.pop(rid)
    assert stepped.plain_steps == m and stepped.acceptance[:m] == [1] * m and len(stepped.acceptance) > m + 3
    assert sum(stepped.acceptance) + 1 >= len(stepped.emitted) == 40  # every round is recorded (+1: prefill's)
    fresh = Runtime(target, drafter, RuntimeConfig(max_batch=1, max_len=160, mode="eager", verify_width=None,
                                                   emit_mask_token=True))
    rid = fresh.add_request(prompt + stepped.emitted[:m], max_new_tokens=40 - m)
    while not fresh.is_finished(rid):
        fresh.step()
    again = fresh.pop(rid)
    assert again.emitted == stepped.emitted[m:] and again.acceptance == stepped.acceptance[m:]


def test_compiled_rounds_have_every_width_of_the_choice_per_bucket(reference_pair):
    target, drafter = reference_pair
    rt = Runtime(target, drafter, RuntimeConfig(max_batch=2, batch_buckets=(2,), max_len=160, mode="compile",
                                                compiler="aot_eager", length_buckets=(64,), verify_width=4,
                                                ar_fallback=True, lookup=False, sampling=False))
    assert {key[3] for key in rt.rounds} == {1, 2, 4} and rt.plan.ar_fallback
    rounds = iter(range(10**6))
    rt.policy.width = lambda rows: (1, 4, 2, 4)[next(rounds) % 4]
    prompts = [c["prompt_ids"] for c in CASES[:2]]
    assert rt.generate(prompts, max_new_tokens=40) == [c["output_ids"][:40] for c in CASES[:2]]
    off = Runtime(target, drafter, RuntimeConfig(max_batch=2, max_len=160, mode="eager", verify_width=2))
    assert off.policy is None and {key[3] for key in off.rounds} == {2}


def test_what_a_policy_learned_carries_over_to_a_new_one():
    """Plain steps won: a policy restored from that state starts with them, and goes on with the same
    retry schedule; a state for other widths, or one that does not parse, leaves a policy as new."""
    learned = RoundPolicy({1: (1, 2)})
    for i in range(200):
        w = learned.width(1)
        learned.record(1, w, K2[w], [min(int(i % 4 == 0) + 1, w)])
    assert learned.width(1) == 1
    state = json.loads(json.dumps(learned.state()))  # as the file holds it
    restored = RoundPolicy({1: (1, 2)})
    restored.restore(state)
    assert restored.width(1) == 1 and restored.state() == learned.state()
    for policy in (learned, restored):
        for _ in range(3 * LONGEST_RETRY):
            w = policy.width(1)
            policy.record(1, w, K2[w], [1])
    assert restored.state() == learned.state()
    for other, bad in ((RoundPolicy({1: (1, 2, 4)}), state), (RoundPolicy({1: (1, 2)}), {"1": {"widths": [1, 2]}}),
                       (RoundPolicy({1: (1, 2)}), {"1": "x"})):
        fresh = json.dumps(other.state())
        other.restore(bad)
        assert json.dumps(other.state()) == fresh


def test_a_runtime_keeps_its_fallbacks_timings_for_the_next(reference_pair):
    target, drafter = reference_pair
    config = RuntimeConfig(max_batch=1, max_len=160, mode="eager", verify_width=None, ar_fallback=True,
                           emit_mask_token=True)
    rt = Runtime(target, drafter, config)
    assert rt.timings is not None and not rt.timings.path.exists()
    rt.generate([CASES[0]["prompt_ids"]], max_new_tokens=30)
    first = json.loads(rt.timings.path.read_text())  # the first request's end writes at once
    assert first["greedy"] == rt.policy.state()
    rt.timings.SAVE_EVERY = 0.0  # later ones at most every few seconds: here every time
    rt.generate([CASES[1]["prompt_ids"]], max_new_tokens=30, temperature=0.7, seed=1)
    kept = json.loads(rt.timings.path.read_text())
    assert kept == {"greedy": rt.policy.state(), "sampled": rt.sampled_policy.state()}
    assert kept["greedy"]["1"]["seconds"] and kept["greedy"] != RoundPolicy({1: rt.plan.round_widths(1)}).state()
    again = Runtime(target, drafter, config)
    assert again.timings.path == rt.timings.path and again.policy.state() == kept["greedy"]
    assert again.sampled_policy.state() == kept["sampled"]
    other = Runtime(target, random_relay(drafter, seed=2), config)  # another drafter accepts otherwise
    assert other.timings.path != rt.timings.path
    off = Runtime(target, drafter, RuntimeConfig(**{**config.__dict__, "keep_timings": False}))
    assert off.timings is None and off.policy.state() == RoundPolicy({1: rt.plan.round_widths(1)}).state()
