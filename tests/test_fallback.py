"""The fallback to plain target steps: the host's choice from timings, and the plain step itself
(lossless, and it keeps the drafter's context, so drafting resumes where it would have been)."""

import pytest

import dflow_rt
from dflow_rt.config import RuntimeConfig
from dflow_rt.fallback import FIRST_RETRY, LONGEST_RETRY, PROBE, RECHECK, ArFallback
from dflow_rt.runtime import Runtime
from tests.helpers import fixed, random_relay
from tests.test_runtime import CASES, record_buckets


def choices(policy: ArFallback, rounds: int, drafted_s: float, plain_s: float, tau) -> list[bool]:
    """The kinds `policy` runs over `rounds` rounds of one bucket whose drafted rounds take `drafted_s`
    and emit `tau(i)` tokens (round i), and whose plain steps take `plain_s`."""
    out = []
    for i in range(rounds):
        d = policy.drafted(1)
        policy.record(1, d, drafted_s if d else plain_s, tau(i) if d else 1.0)
        out.append(d)
    return out


def gaps(kinds: list[bool]) -> list[int]:
    """Lengths of the runs of plain steps between drafted rounds."""
    runs, n = [], 0
    for d in kinds:
        if d:
            if n:
                runs.append(n)
            n = 0
        else:
            n += 1
    return runs


def test_plain_steps_take_over_when_drafting_loses_and_retries_back_off():
    """tau 1.25 in 30 ms against one token in 20 ms: 41.7 against 50 tokens/s."""
    kinds = choices(ArFallback(), 4000, 0.030, 0.020, lambda i: 1.25)
    assert kinds[:3] == [True] * 3 and kinds[3:3 + PROBE] == [False] * PROBE
    assert gaps(kinds)[:6] == [PROBE + FIRST_RETRY, 2 * FIRST_RETRY, 4 * FIRST_RETRY, 8 * FIRST_RETRY, 16 * FIRST_RETRY,
                               LONGEST_RETRY]
    assert sum(kinds[1000:]) / 3000 < 0.01


def test_drafting_stays_while_it_pays_with_a_plain_timing_now_and_then():
    """tau 2 in 30 ms against one token in 20 ms."""
    kinds = choices(ArFallback(), 3000, 0.030, 0.020, lambda i: 2.0)
    assert set(gaps(kinds[10:])) == {PROBE}
    assert (len(kinds) - sum(kinds)) <= PROBE * (len(kinds) // RECHECK + 2)


def test_a_drafter_that_stops_paying_is_dropped_at_once_and_retried():
    """tau falls from 2 to 1 at round 1000: the window's mean passes 1.5 (the break-even) within 9
    drafted rounds, with no probe; plain steps follow until the first retry."""
    kinds = choices(ArFallback(), 1500, 0.030, 0.020, lambda i: 2.0 if i < 1000 else 1.0)
    assert set(gaps(kinds[600:1000])) <= {PROBE}
    first_plain = next(i for i in range(1000, 1500) if not any(kinds[i:i + FIRST_RETRY]))
    assert first_plain <= 1000 + 9 + PROBE and kinds[first_plain + FIRST_RETRY]


def test_a_retry_on_easier_text_brings_drafting_back():
    """tau 1 until round 300, then 2: the first retry after that drafts again for good, although the
    window of drafted rounds still held the weak stretch's rounds when plain steps took over."""
    kinds = choices(ArFallback(), 1000, 0.030, 0.020, lambda i: 1.0 if i < 300 else 2.0)
    assert sum(kinds[:300]) < 20  # plain steps, but for the backed-off retries
    back = next(i for i in range(300, 1000) if kinds[i])
    assert set(gaps(kinds[back:])) <= {PROBE} and sum(kinds[back:]) > 0.95 * (1000 - back)


def _fallback_runtime(target, drafter, schedule, **settings) -> Runtime:
    """A Runtime with the fallback whose choice follows `schedule(round)` instead of timings."""
    rt = Runtime(target, drafter, RuntimeConfig(max_batch=2, max_len=160, mode="eager", verify_width=None,
                                                ar_fallback=True, **settings))
    rounds = iter(range(10**6))
    rt.fallback.drafted = lambda rows: schedule(next(rounds))
    return rt


@pytest.mark.parametrize("relay", [False, True], ids=["dflash", "dflow"])
def test_plain_steps_between_drafted_rounds_are_lossless(reference_pair, relay):
    target, drafter = reference_pair
    drafter = random_relay(drafter, seed=1) if relay else drafter
    rt = _fallback_runtime(target, drafter, lambda i: i % 5 in (0, 3), emit_mask_token=True)
    used = record_buckets(rt)
    prompts = [c["prompt_ids"] for c in CASES[:3]]
    outs = rt.generate(prompts, max_new_tokens=48)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = dflow_rt.reference.generate(target, drafter, prompt, 48, config=fixed(emit_mask_token=True))
        assert out == ref.token_ids
    assert {key[3] for key in used} == {1, drafter.block_size}


def test_plain_steps_keep_the_drafters_context(reference_pair):
    """After m plain steps, the drafted rounds accept what a Runtime that prefilled the prompt and
    those m tokens accepts: the plain steps wrote every committed token's features to the drafter."""
    target, drafter = reference_pair
    prompt, m = CASES[0]["prompt_ids"], 7
    rt = _fallback_runtime(target, drafter, lambda i: i >= m, emit_mask_token=True)
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


def test_compiled_rounds_have_a_plain_step_per_bucket(reference_pair):
    target, drafter = reference_pair
    rt = Runtime(target, drafter, RuntimeConfig(max_batch=2, batch_buckets=(2,), max_len=160, mode="compile",
                                                compiler="aot_eager", length_buckets=(64,), verify_width=2,
                                                ar_fallback=True))
    assert {key[3] for key in rt.rounds} == {1, 2} and rt.plan.ar_fallback
    rounds = iter(range(10**6))
    rt.fallback.drafted = lambda rows: next(rounds) % 3 == 0
    prompts = [c["prompt_ids"] for c in CASES[:2]]
    assert rt.generate(prompts, max_new_tokens=40) == [c["output_ids"][:40] for c in CASES[:2]]
    off = Runtime(target, drafter, RuntimeConfig(max_batch=2, max_len=160, mode="eager", verify_width=2))
    assert off.fallback is None and {key[3] for key in off.rounds} == {2}
