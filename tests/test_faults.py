"""Isolation: a request that goes wrong ends alone, and nothing it leaves behind reaches another.

NaN rows fail with an error while the other rows decode exactly as they would alone; a failed
row is clean before its next request; the drafter's mask token is never emitted; requests can be
cancelled in every state; a stream keeps every token whoever steps the Runtime; step() refuses
concurrent and re-entrant calls.
"""

import json
import threading

import pytest

import dflow_rt
import dflow_rt.oracle
from dflow_rt import BusyError, InputError, RequestError
from dflow_rt.engine.runtime import Runtime
from tests.conftest import FIXTURES
from tests.helpers import fixed, poison

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]
PROMPTS = [c["prompt_ids"] for c in CASES]


def alone(target, drafter, prompt, n=40, **kw) -> list[int]:
    """The request's tokens with nothing else in the Runtime."""
    return Runtime(target, drafter, fixed(max_batch=1, max_len=160)).generate([prompt], max_new_tokens=n,
                                                                                      **kw)[0]


def run(rt: Runtime, rids: list[int]) -> None:
    while not all(rt.is_finished(r) for r in rids):
        rt.step()


def test_a_nan_row_fails_alone_and_its_row_is_clean_for_the_next_request(reference_pair):
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=3, max_len=160))
    kws = [{}, {"temperature": 0.8, "seed": 4}, {"temperature": 1.0, "top_k": 5, "seed": 9}]
    rids = [rt.add_request(p, max_new_tokens=40, **kw) for p, kw in zip(PROMPTS, kws, strict=False)]
    rt.step()
    victim = rt.requests[rids[1]]
    row = victim.row
    poison(rt, row, 100)  # the victim's logits go NaN at once, and so would a later request's in this row
    rt.step()
    assert victim.finished and victim.error and "NaN" in victim.error and victim.row == -1
    fresh = rt.add_request(PROMPTS[3], max_new_tokens=40)  # the others still run: it takes the victim's row
    rt.step()
    assert rt.requests[fresh].row == row
    run(rt, rids + [fresh])
    for rid, prompt, kw in [(rids[0], PROMPTS[0], kws[0]), (rids[2], PROMPTS[2], kws[2]), (fresh, PROMPTS[3], {})]:
        req = rt.pop(rid)
        assert req.error is None and req.emitted == alone(target, drafter, prompt, **kw)
    assert not rt.state.faulted.any()


@pytest.fixture
def nan_prefill(reference_pair):
    """Make the target's prefill of any 7-token prompt (only CASES[4]) non-finite."""
    target, _ = reference_pair
    length = len(PROMPTS[4])
    assert sum(len(p) == length for p in PROMPTS) == 1

    def poison(module, inputs, out):
        return out.fill_(float("nan")) if out.shape[1] == length else out

    hook = target.model.layers[1].register_forward_hook(poison)
    yield PROMPTS[4]
    hook.remove()


def test_a_request_whose_prefill_goes_nan_fails_and_raises_in_stream_and_generate(reference_pair, nan_prefill):
    target, drafter = reference_pair
    expected = alone(target, drafter, PROMPTS[0])
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
    good, bad = rt.add_request(PROMPTS[0], max_new_tokens=40), rt.add_request(nan_prefill, max_new_tokens=40)
    first = rt.step()
    assert first[bad] == [] and rt.requests[bad].error and not rt.requests[bad].emitted
    run(rt, [good, bad])
    assert rt.pop(good).emitted == expected
    with pytest.raises(RequestError, match="NaN"):
        rt.generate([PROMPTS[0], nan_prefill], max_new_tokens=10)
    with pytest.raises(RequestError):
        list(rt.stream(nan_prefill, max_new_tokens=10))
    rt.pop(bad)
    assert rt.requests == {} and sorted(rt.scheduler.free_rows) == [0, 1]
    assert rt.generate([PROMPTS[0]], max_new_tokens=40) == [expected]


def test_the_mask_token_is_never_emitted(reference_pair):
    """A target that prefers the drafter's mask token: the Runtime (greedy and sampled) and the
    reference round emit the target's choice among all other tokens."""
    target, drafter = reference_pair
    mask, prompt = drafter.config.mask_token_id, PROMPTS[0]

    def prefer_mask(module, inputs, logits):
        logits[..., mask] += 6.0
        return logits

    def forbid_mask(module, inputs, logits):
        logits[..., mask] = float("-inf")
        return logits

    hooks = [target.lm_head.register_forward_hook(prefer_mask)]
    try:
        assert dflow_rt.oracle.generate(target, None, prompt, max_new_tokens=30).token_ids.count(mask) > 10
        rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
        greedy = rt.generate([prompt], max_new_tokens=30)[0]
        sampled = rt.generate([prompt, prompt], max_new_tokens=30, temperature=1.0)
        reference = dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=30).token_ids
        hooks.append(target.lm_head.register_forward_hook(forbid_mask))
        without_mask = dflow_rt.oracle.generate(target, None, prompt, max_new_tokens=30).token_ids
    finally:
        for hook in hooks:
            hook.remove()
    assert mask not in greedy + sampled[0] + sampled[1]
    assert greedy == reference == without_mask


def test_cancel_while_waiting_running_and_finished(reference_pair):
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
    a, b, waiting = (rt.add_request(p, max_new_tokens=30) for p in PROMPTS[:3])
    rt.step()
    assert rt.requests[waiting].row == -1
    rt.cancel(waiting)
    assert rt.is_finished(waiting) and rt.pop(waiting).emitted == [] and len(rt.scheduler.waiting) == 0
    running = rt.requests[b]
    rt.cancel(b)
    assert running.finished and running.row == -1 and running.emitted == alone(target, drafter, PROMPTS[1])[
        :len(running.emitted)]
    run(rt, [a])
    done = list(rt.requests[a].emitted)
    rt.cancel(a)  # finished: nothing changes
    assert rt.requests[a].emitted == done == alone(target, drafter, PROMPTS[0], 30)
    rt.pop(a), rt.pop(b)
    with pytest.raises(InputError, match="already popped"):
        rt.cancel(a)
    assert sorted(rt.scheduler.free_rows) == [0, 1] and rt.requests == {}


def test_streams_side_by_side_keep_every_token(reference_pair):
    """Each stream's step() also runs the other's rows and a plain request's: no token is lost."""
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=3, max_len=160))
    other = rt.add_request(PROMPTS[2], max_new_tokens=40)
    streams = {0: rt.stream(PROMPTS[0], max_new_tokens=40), 1: rt.stream(PROMPTS[1], max_new_tokens=25)}
    got: dict[int, list[int]] = {0: [], 1: []}
    while streams:
        for k in list(streams):
            try:
                got[k] += next(streams[k])
            except StopIteration:
                del streams[k]
    assert got[0] == alone(target, drafter, PROMPTS[0]) and got[1] == alone(target, drafter, PROMPTS[1], 25)
    run(rt, [other])
    assert rt.pop(other).emitted == alone(target, drafter, PROMPTS[2])


def test_generate_leaves_nothing_behind_on_a_bad_prompt(reference_pair):
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
    with pytest.raises(InputError):
        rt.generate([PROMPTS[0], [1, 2, 10_000]], max_new_tokens=10)
    assert rt.requests == {} and not rt.scheduler.waiting


def test_step_refuses_concurrent_and_reentrant_calls(reference_pair):
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
    rid = rt.add_request(PROMPTS[0], max_new_tokens=30)
    rounds, inside, release, results = dict(rt.rounds), threading.Event(), threading.Event(), []

    def held(go):
        def round_() -> None:
            inside.set()
            release.wait(30)
            go()
        return round_

    rt.rounds = {key: held(go) for key, go in rounds.items()}
    worker = threading.Thread(target=lambda: results.append(rt.step()))
    worker.start()
    assert inside.wait(30)
    for call in (rt.step, lambda: rt.cancel(rid), lambda: rt.pop(rid)):
        with pytest.raises(BusyError, match="while a step"):
            call()
    release.set()
    worker.join(30)
    assert results and results[0][rid]
    rt.rounds = {key: (lambda go=go: (rt.step(), go())) for key, go in rounds.items()}
    with pytest.raises(BusyError):
        rt.step()  # the round calls step() again
    rt.rounds = rounds
    run(rt, [rid])
    assert rt.pop(rid).emitted == alone(target, drafter, PROMPTS[0], 30)
