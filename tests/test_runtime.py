"""Runtime.step(): every mode emits the reference round's tokens; static state; sampling."""

import json

import pytest
import torch
from torch._dynamo.utils import counters

import dflow_rt
import dflow_rt.oracle
from dflow_rt.config import RuntimeConfig
from dflow_rt.engine.runtime import Runtime
from dflow_rt.errors import InputError
from dflow_rt.graphs.prefill import keys_read
from tests.conftest import FIXTURES
from tests.helpers import fixed, random_relay, whole_block

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]


def per_round(rt: Runtime, prompts, max_new_tokens):
    """Run to completion; per request, the list of token counts each step emitted."""
    rids = [rt.add_request(p, max_new_tokens=max_new_tokens) for p in prompts]
    counts = {r: [] for r in rids}
    while not all(rt.is_finished(r) for r in rids):
        for rid, toks in rt.step().items():
            counts[rid].append(len(toks))
    return [rt.pop(r).emitted for r in rids], [counts[r] for r in rids]


def record_buckets(rt: Runtime) -> set[tuple[int, int, bool, int]]:
    """The (rows, length, greedy, width) buckets that `rt`'s steps run from now on."""
    used = set()

    def recording(key, run):
        return lambda: (used.add(key), run())

    rt.rounds = {key: recording(key, run) for key, run in rt.rounds.items()}
    return used


def reference_counts(out):
    """Tokens per round as the Runtime reports them: the first round also carries the prefill token."""
    counts = list(out.acceptance_lengths)
    counts[0] += 1
    extra = sum(counts) - len(out.token_ids)
    counts[-1] -= extra  # the last round may be cut by max_new_tokens
    return counts


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_every_mode_matches_the_reference_round(reference_pair, mode):
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=4, max_len=160, mode=mode, emit_mask_token=True, sampling=False,
                                        length_buckets=(48, 80, 112), compiler="aot_eager"))  # greedy requests only
    used = record_buckets(rt)
    outs, counts = per_round(rt, [c["prompt_ids"] for c in CASES], 64)
    assert len({key[1] for key in used}) >= 2, used
    assert any(drafter.config.mask_token_id in c["output_ids"] for c in CASES)  # the public round emits it here
    for case, out, cnt in zip(CASES, outs, counts, strict=True):
        ref = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], 64, config=fixed(emit_mask_token=True))
        assert out == ref.token_ids == case["output_ids"]
        assert cnt == reference_counts(ref)


def test_inductor_round_matches_reference_round(reference_pair):
    """The real compiler path (inductor, symbolic cache length, a greedy and a sampling variant
    chosen by the host), one batch bucket of 2 rows: greedy rounds as the reference and on the
    greedy variant, sampled ones as eager and on the sampling variant, three requests sharing
    the two rows."""
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=2, batch_buckets=(2,), max_len=160, mode="compile",
                                                length_buckets=(64,)))
    used = record_buckets(rt)
    outs, counts = per_round(rt, [c["prompt_ids"] for c in CASES[:3]], 64)
    for case, out, cnt in zip(CASES[:3], outs, counts, strict=True):
        ref = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=64)
        assert out == ref.token_ids == case["output_ids"] and cnt == reference_counts(ref)
    assert {key[1] for key in used} == {64, 160} and {key[2] for key in used} == {True}
    eager = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
    kw = {"max_new_tokens": 48, "temperature": 1.0, "top_p": 0.9, "seed": 3}
    pair = [CASES[0]["prompt_ids"], CASES[1]["prompt_ids"]]
    used.clear()
    assert rt.generate(pair, **kw) == eager.generate(pair, **kw)
    assert {key[2] for key in used} == {False}


def test_a_greedy_only_runtime_builds_no_sampling_round(reference_pair):
    """sampling=False: only greedy rounds exist (half the graphs to compile), they decode the
    reference's tokens, and a request that would sample is refused before it queues."""
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=2, batch_buckets=(2,), max_len=160, mode="compile",
                                        compiler="aot_eager", length_buckets=(64,), sampling=False))
    assert {key[2] for key in rt.rounds} == {True}
    both = Runtime(target, drafter, fixed(max_batch=2, batch_buckets=(2,), max_len=160, length_buckets=(64,)))
    assert len(rt.rounds) == len(both.rounds) // 2
    with pytest.raises(InputError, match="greedy rounds only"):
        rt.add_request(CASES[0]["prompt_ids"], max_new_tokens=8, temperature=0.7)
    assert not rt.scheduler.waiting
    outs, counts = per_round(rt, [c["prompt_ids"] for c in CASES[:2]], 64)
    for case, out, cnt in zip(CASES[:2], outs, counts, strict=True):
        ref = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=64)
        assert out == ref.token_ids == case["output_ids"] and cnt == reference_counts(ref)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_greedy_and_sampled_rows_share_a_round(reference_pair, mode):
    """Greedy rounds skip the sampler on CPU; a batch mixing greedy and sampled rows must
    still give each request exactly the tokens it gets alone."""
    target, drafter = reference_pair
    cfg = fixed(max_batch=4, batch_buckets=(4,), max_len=160, mode=mode, compiler="aot_eager")
    rt, alone = Runtime(target, drafter, cfg), Runtime(target, drafter, fixed(max_batch=1, max_len=160))
    kws = [{}, {"temperature": 1.0, "seed": 5}, {}, {"temperature": 0.8, "top_k": 4, "seed": 6}]
    rids = [rt.add_request(c["prompt_ids"], max_new_tokens=40, **kw) for c, kw in zip(CASES, kws, strict=False)]
    while not all(rt.is_finished(r) for r in rids):
        rt.step()
    for rid, case, kw in zip(rids, CASES, kws, strict=False):
        assert rt.pop(rid).emitted == alone.generate([case["prompt_ids"]], max_new_tokens=40, **kw)[0]
    assert not rt.state.temperature.any(), "finished rows must not leave rounds on the sampling path"


@pytest.mark.parametrize("relay_input", ["mask_embedding", "kv"])
def test_dflow_relay_in_static_round_matches_reference_round(reference_pair, relay_input):
    target, parent = reference_pair
    drafter = random_relay(parent, relay_input=relay_input)
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
    outs, counts = per_round(rt, [c["prompt_ids"] for c in CASES[:4]], 48)
    for case, out, cnt in zip(CASES[:4], outs, counts, strict=True):
        ref = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=48)
        assert out == ref.token_ids and cnt == reference_counts(ref)


def test_static_round_projects_the_verify_record_once(reference_pair):
    """The static round's context is the verify record's features: `fc` runs on them once a round,
    not once for the context and again for the relay."""
    target, parent = reference_pair
    drafter = random_relay(parent)
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160, mode="eager"))
    rt.add_request(CASES[0]["prompt_ids"], max_new_tokens=100)
    rt.step()  # prefill and a first round
    calls = []
    hook = drafter.fc.register_forward_hook(lambda *_: calls.append(1))
    try:
        rt.step()
    finally:
        hook.remove()
    assert len(calls) == 1


def test_no_recompiles_and_fixed_storage_over_200_rounds(reference_pair):
    target, drafter = reference_pair
    torch._dynamo.reset()
    counters.clear()
    rt = Runtime(target, drafter, fixed(max_batch=4, max_len=2048, mode="compile", sampling=False,
                                        length_buckets=(48, 64, 96), compiler="aot_eager"))  # greedy requests only
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == len(rt.plan.buckets), "per batch bucket, one (greedy) graph; the length symbolic"
    used = record_buckets(rt)
    ptrs = [t.data_ptr() for t in rt.state.tensors()]
    rounds, sizes, accepted = 0, set(), set()
    rid_cycle = 0
    while rounds < 200:
        live = [r for r in rt.rows if r is not None]
        if len(live) < 1 + rounds % 4 or rounds % 37 == 0:  # requests join and leave all the time
            case = CASES[rid_cycle % len(CASES)]
            rt.add_request(case["prompt_ids"], max_new_tokens=16 + 11 * (rid_cycle % 5))
            rid_cycle += 1
        if rounds % 29 == 5 and live:
            rt.cancel(live[-1].rid)
        out = rt.step()
        sizes.add(len(out))
        accepted |= {len(t) for t in out.values()}
        rounds += 1
    assert counters["stats"]["unique_graphs"] == graphs, "a step recompiled"
    assert [t.data_ptr() for t in rt.state.tensors()] == ptrs
    assert len(sizes) >= 3 and len(accepted) >= 3, (sizes, accepted)
    assert len({key[0] for key in used}) >= 2 and len({key[1] for key in used}) >= 3, used


def test_requests_join_leave_and_cancel(reference_pair):
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
    a = rt.add_request(CASES[0]["prompt_ids"], max_new_tokens=30)
    rt.step()
    b = rt.add_request(CASES[1]["prompt_ids"], max_new_tokens=30)
    c = rt.add_request(CASES[2]["prompt_ids"], max_new_tokens=30)  # waits for a free row
    rt.step()
    assert rt.requests[c].row == -1 and not rt.is_finished(c)
    rt.cancel(b)
    assert rt.is_finished(b)
    while not (rt.is_finished(a) and rt.is_finished(c)):
        rt.step()
    assert rt.requests[a].emitted == CASES[0]["output_ids"][:30]
    assert rt.requests[c].emitted == CASES[2]["output_ids"][:30]
    streamed = [t for piece in rt.stream(CASES[3]["prompt_ids"], max_new_tokens=20) for t in piece]
    assert streamed == CASES[3]["output_ids"][:20]


def test_bad_buckets_are_refused(reference_pair):
    target, drafter = reference_pair
    for bad in ({"batch_buckets": (0,)}, {"batch_buckets": (5,)}, {"length_buckets": (drafter.block_size,)},
                {"length_buckets": (200,)}):
        with pytest.raises(dflow_rt.InputError, match="buckets"):
            Runtime(target, drafter, fixed(max_batch=4, max_len=160, **bad))


def test_finished_requests_are_released(reference_pair):
    """A long-running Runtime holds no record of requests it has handed back."""
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160))
    a = rt.add_request(CASES[0]["prompt_ids"], max_new_tokens=30)
    rt.step()
    with pytest.raises(dflow_rt.InputError, match="still running"):
        rt.pop(a)
    while not rt.is_finished(a):
        rt.step()
    req = rt.pop(a)
    assert req.emitted == CASES[0]["output_ids"][:30] and 1 + sum(req.acceptance) >= 30  # plus the prefill token
    assert rt.generate([CASES[1]["prompt_ids"]], max_new_tokens=10) == [CASES[1]["output_ids"][:10]]
    for _ in rt.stream(CASES[2]["prompt_ids"], max_new_tokens=40):
        break  # the consumer walks away: the request is cancelled and its row freed
    assert rt.requests == {} and all(r is None for r in rt.rows) and sorted(rt.scheduler.free_rows) == [0, 1]
    with pytest.raises(dflow_rt.InputError, match="already popped"):
        rt.is_finished(a)


def test_stop_tokens_and_bad_requests(reference_pair):
    target, drafter = reference_pair
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=128))
    full = CASES[0]["output_ids"]
    stop = full[10]
    [out] = rt.generate([CASES[0]["prompt_ids"]], max_new_tokens=64, stop_token_ids=[stop])
    assert out == full[: full.index(stop) + 1]
    with pytest.raises(dflow_rt.InputError, match="max_len"):
        rt.add_request([1] * 100, max_new_tokens=64)
    with pytest.raises(dflow_rt.InputError):
        rt.add_request([1, 2], temperature=-1)
    with pytest.raises(dflow_rt.InputError):
        Runtime(target, drafter, fixed(mode="cudagraph"))


def test_sampling_is_reproducible_and_pathwise_autoregressive(reference_pair):
    target, drafter = reference_pair
    spec = Runtime(target, drafter, fixed(max_batch=4, max_len=160))
    plain = Runtime(target, None, fixed(max_batch=4, max_len=160))
    prompts = [c["prompt_ids"] for c in CASES[:4]]

    def without_mask(module, inputs, logits):  # the law speculation samples: the target's, less the mask token
        logits[..., drafter.config.mask_token_id] = float("-inf")
        return logits

    for kw in ({"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8}):
        a = spec.generate(prompts, max_new_tokens=40, seed=11, **kw)
        assert a == spec.generate(prompts, max_new_tokens=40, seed=11, **kw)
        hook = target.lm_head.register_forward_hook(without_mask)
        try:
            assert a == plain.generate(prompts, max_new_tokens=40, seed=11, **kw)
        finally:
            hook.remove()
        assert a != spec.generate(prompts, max_new_tokens=40, seed=12, **kw)


def test_finished_rows_stay_inside_a_tight_cache(reference_pair):
    """A finished row keeps running as padding; its last round can leave it within B of max_len, so the
    Runtime must park it (max_len here is exactly what add_request demands)."""
    target, drafter = reference_pair
    # Case 2 (the longest prompt) accepts all 16 tokens a round and ends 9 past max_new while case 5
    # (about 1 token a round) still runs beside it.
    prompts = [CASES[2]["prompt_ids"], CASES[5]["prompt_ids"], CASES[2]["prompt_ids"]]
    max_new = 40
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=max(map(len, prompts)) + max_new + 16))
    outs = rt.generate(prompts, max_new_tokens=max_new)
    for p, out in zip(prompts, outs, strict=True):
        assert out == dflow_rt.oracle.generate(target, drafter, p, max_new_tokens=max_new).token_ids


@pytest.mark.parametrize("relay, whole", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["dflash", "dflow", "dflash-whole-block", "dflow-whole-block"])
def test_every_verify_width_matches_the_reference_round(reference_pair, relay, whole):
    """Verifying only the first k of B drafted positions is lossless at every k, and the Runtime's
    rounds are the reference round's at that k (acceptance capped at k, relay counts k - 1 - a),
    with the draft pass cut to the k positions or, for a `draft_whole_block` drafter, over the block."""
    target, drafter = reference_pair
    drafter = random_relay(drafter, seed=1) if relay else drafter
    drafter = whole_block(drafter) if whole else drafter
    prompts = [c["prompt_ids"] for c in CASES[:3]]
    greedy = [c["output_ids"][:40] for c in CASES[:3]]
    longest = {}
    # a whole-block draft pass is the same at every k: the widths around powers of two, for CI's time
    widths = (1, 2, 3, 4, 7, 8, 15, 16) if whole else range(1, drafter.block_size + 1)
    for k in widths:
        rt = Runtime(target, drafter, RuntimeConfig(mode="eager", max_batch=2, max_len=96, verify_width=k))
        outs, counts = per_round(rt, prompts, 40)
        for prompt, out, cnt, truth in zip(prompts, outs, counts, greedy, strict=True):
            ref = dflow_rt.oracle.generate(target, drafter, prompt, 40, config=fixed(verify_width=k))
            assert out == ref.token_ids == truth, k
            assert cnt == reference_counts(ref), k
            assert max(ref.acceptance_lengths) <= k
        longest[k] = max(max(c) for c in counts)
    assert longest[1] == 2 and longest[16] > longest[4] > 2, longest  # widths really cap acceptance


def test_compiled_whole_block_round_matches_the_reference_round(reference_pair):
    """A `draft_whole_block` DFlow drafter's padded pass traces into one static compiled round and
    drafts there as the reference round does (relay rows past the verified ones padded with zeros)."""
    target, drafter = reference_pair
    drafter = whole_block(random_relay(drafter, seed=1))
    rt = Runtime(target, drafter, RuntimeConfig(mode="compile", compiler="aot_eager", max_batch=2, max_len=96,
                                                verify_width=4, ar_fallback=False, sampling=False))
    prompts = [c["prompt_ids"] for c in CASES[:2]]
    outs, counts = per_round(rt, prompts, 40)
    for prompt, out, cnt, case in zip(prompts, outs, counts, CASES, strict=False):
        ref = dflow_rt.oracle.generate(target, drafter, prompt, 40, config=fixed(verify_width=4))
        assert out == ref.token_ids == case["output_ids"][:40] and cnt == reference_counts(ref)


@pytest.mark.parametrize("relay", [False, True], ids=["dflash", "dflow"])
def test_relay_rows_past_the_widest_verify_are_never_read(reference_pair, relay):
    """A round writes only the relay rows a verify of this Runtime can commit to the drafter's
    context: NaN in the rows past the widest width (4) changes neither tokens nor acceptance. (With
    every row written, the NaN keys reach the draft pass's masked SDPA, where 0 * NaN is NaN.)"""
    target, drafter = reference_pair
    drafter = random_relay(drafter, seed=1) if relay else drafter
    prompts = [c["prompt_ids"] for c in CASES[:2]]
    runs = []
    for poison in (False, True):
        rt = Runtime(target, drafter, RuntimeConfig(mode="eager", max_batch=2, max_len=96, verify_width=4,
                                                    ar_fallback=False, kernels={"attention": "torch"}))
        assert rt.plan.max_width == 4
        if poison:
            rt.state.last_verify.features[:, 4:] = float("nan")
        runs.append(per_round(rt, prompts, 40))
    assert runs[0] == runs[1]
    assert runs[0][0] == [c["output_ids"][:40] for c in CASES[:2]]


def test_verify_width_per_batch_bucket(reference_pair):
    target, drafter = reference_pair
    config = RuntimeConfig(max_batch=4, max_len=96, batch_buckets=(1, 4), verify_width={1: 3},
                           mode="compile", compiler="aot_eager", sampling=False)
    rt = Runtime(target, drafter, config)
    assert rt.plan.widths == {1: 3, 4: 16}
    prompts = [c["prompt_ids"] for c in CASES[:4]]
    outs, _ = per_round(rt, prompts[:1], 40)  # one request: bucket 1, width 3
    assert outs[0] == CASES[0]["output_ids"][:40] and max(rt_acceptance(rt, prompts[0])) <= 3
    outs, _ = per_round(rt, prompts, 40)  # four: bucket 4, the full block
    assert outs == [c["output_ids"][:40] for c in CASES[:4]]
    for bad in ({2: 3}, {1: 0}, {1: 17}, 1.5):
        with pytest.raises(dflow_rt.InputError, match="verify_width"):
            Runtime(target, drafter, fixed(max_batch=4, max_len=96, batch_buckets=(1, 4), verify_width=bad))


def rt_acceptance(rt: Runtime, prompt) -> list[int]:
    rid = rt.add_request(prompt, max_new_tokens=40)
    while not rt.is_finished(rid):
        rt.step()
    return rt.pop(rid).acceptance


def test_chunked_prefill_emits_the_same_tokens_while_rows_decode(reference_pair):
    """With a per-step prompt budget (`prefill_chunk`), prompts that join while rows decode are
    prefilled over several steps, the decoding rows run every step, and every request's tokens are
    the whole-prompt Runtime's: greedy ones the reference's, seeded sampled ones alike, rows reused."""
    target, drafter = reference_pair
    cases = CASES[:6]

    def run(config: RuntimeConfig, **sampling) -> tuple[list[list[int]], list[int]]:
        rt = Runtime(target, drafter, config)
        rids, decoding = [], []
        for i, case in enumerate(cases):  # one joins every other step, beside the running ones
            rids.append(rt.add_request(case["prompt_ids"], max_new_tokens=24, seed=i, **sampling))
            for _ in range(2):
                running = [r for r in rids if not rt.is_finished(r)
                           and rt.requests[r].prefilled == rt.requests[r].prompt.numel()]
                emitted = rt.step()
                decoding.append(all(emitted.get(r) for r in running))
        while not all(rt.is_finished(r) for r in rids):
            rt.step()
        return [rt.pop(r).emitted for r in rids], decoding

    whole = fixed(max_batch=3, max_len=160)
    chunked = fixed(max_batch=3, max_len=160, prefill_chunk=5)  # prompts of 7-37 tokens: 2-8 chunks
    tokens, decoding = run(chunked)
    assert tokens == [c["output_ids"][:24] for c in cases] == run(whole)[0]
    assert all(decoding), "a row that was decoding got no tokens in a step that prefilled a chunk"
    sampled = run(chunked, temperature=1.0, top_k=8)[0]
    assert sampled == run(whole, temperature=1.0, top_k=8)[0]
    # the decoding row ends while one prompt is part-way in and another of the same length has not
    # started: the rest of the first and the whole of the second go in as separate prefills
    long = max(cases, key=lambda c: len(c["prompt_ids"]))
    rt = Runtime(target, drafter, chunked)
    first = rt.add_request(cases[0]["prompt_ids"], max_new_tokens=24)
    rt.step()
    pair = [rt.add_request(long["prompt_ids"], max_new_tokens=24) for _ in range(2)]
    rt.step()
    rt.cancel(first)
    assert [rt.requests[r].prefilled for r in pair] == [5, 0]
    while not all(rt.is_finished(r) for r in pair):
        rt.step()
    assert [rt.pop(r).emitted for r in pair] == [long["output_ids"][:24]] * 2
    with pytest.raises(InputError, match="prefill_chunk"):
        Runtime(target, drafter, fixed(max_batch=1, max_len=64, prefill_chunk=0))


def test_a_prompt_pass_over_keys_cut_at_a_key_block_is_bit_identical(reference_pair):
    """On CPU a prompt (or chunk) attends over the cache up to its end rounded up to SDPA's key block
    (`keys_read`): the same logits, bit for bit, as over the whole cache."""
    target, _ = reference_pair
    cache, rows = target.new_cache(2, 1000), torch.tensor([1])  # the fixture's rotary table: 1,024
    torch.manual_seed(0)
    for begin, end in ((0, 37), (0, 512), (480, 530), (600, 616), (990, 1000)):
        ids = torch.randint(0, target.config.vocab_size, (1, end - begin))
        pos = torch.arange(begin, end)[None]
        with torch.inference_mode():
            whole, _ = target(ids, pos, cache, rows)
            n = keys_read(end, cache.max_len)
            cut, _ = target(ids, pos, cache.view(2, n), rows)
        assert n in (512, 1000) and torch.equal(whole, cut), (begin, end)
