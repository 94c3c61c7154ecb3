"""Lossless sampling: speculative decoding draws from the same law as plain target sampling
(the target's law without the drafter's mask token, which is never emitted)."""

import json
from collections import Counter

import pytest
import torch
from transformers import SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflow_rt.engine.runtime import Runtime
from dflow_rt.kernels.sampling import sample
from dflow_rt.models.drafter import relay_off
from tests.conftest import FIXTURES
from tests.helpers import fixed, ours_from_hf, random_relay, tiny_drafter, tiny_hf_target

N = 20_000
PROMPT = [1, 3, 0, 2]


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of a chi-square homogeneity test of two samples of equal size over shared cells.

    Cells seen fewer than 10 times in both samples together are pooled into one cell so that
    the chi-square approximation holds.
    """
    cells = set(a) | set(b)
    small = {c for c in cells if a[c] + b[c] < 10}
    rows = [(a[c], b[c]) for c in cells - small] + [(sum(a[c] for c in small), sum(b[c] for c in small))]
    rows = [r for r in rows if sum(r) > 0]
    stat = sum((x - y) ** 2 / (x + y) for x, y in rows)  # equal sample sizes
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@torch.no_grad()
def plain_target_samples(hf, temperature, top_k, top_p, n=N, steps=3, exclude=None, seed=1234) -> Counter:
    """Reference: transformers' own logits processors and torch.multinomial, no speculation;
    `exclude` is a token the sampler never draws (the mask token of the drafter beside it)."""
    warpers = [] if exclude is None else [SuppressTokensLogitsProcessor([exclude])]
    warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT] * n)
    for _ in range(steps):
        scores = hf(ids).logits[:, -1].float()
        for w in warpers:
            scores = w(ids, scores)
        nxt = torch.multinomial(torch.softmax(scores, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
    return Counter(tuple(r) for r in ids[:, len(PROMPT):].tolist())


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 3, 1.0), (1.3, 0, 0.7)])
def test_speculative_sampling_matches_target_sampling(temperature, top_k, top_p):
    hf = tiny_hf_target(seed=7, vocab=5, layers=2)
    hf.model.embed_tokens.weight.data *= 0.5  # softer logits: every joint outcome has mass
    target = ours_from_hf(hf)
    drafter = tiny_drafter(target, seed=3, block_size=4)
    rt = Runtime(target, drafter, fixed(max_batch=N, max_len=16, batch_buckets=(N,)))
    rids = [rt.add_request(PROMPT, max_new_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, seed=i)
            for i in range(N)]
    accepted = Counter()
    while not all(rt.is_finished(r) for r in rids):
        for toks in rt.step().values():
            accepted[len(toks)] += 1
    spec = Counter(tuple(rt.pop(r).emitted) for r in rids)
    assert len(accepted) > 1, "the drafter should be accepted sometimes, or the test checks nothing"
    p = chi_square_p(spec, plain_target_samples(hf, temperature, top_k, top_p, exclude=drafter.config.mask_token_id))
    assert p > 1e-3, p


def test_chi_square_detects_a_biased_sampler():
    """The statistic has power at this sample size: a slightly too hot sampler fails it."""
    hf = tiny_hf_target(seed=7, vocab=5, layers=2)
    hf.model.embed_tokens.weight.data *= 0.5
    assert chi_square_p(plain_target_samples(hf, 1.0, 0, 1.0, steps=2),
                        plain_target_samples(hf, 1.15, 0, 1.0, steps=2)) < 1e-3


def test_sample_filters_match_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 7) * 2
    for temperature, top_k, top_p in [(1.0, 2, 1.0), (0.5, 0, 0.6), (2.0, 4, 0.9)]:
        scores = TemperatureLogitsWarper(temperature)(None, logits.flatten(0, 1).clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        allowed = torch.isfinite(scores).view(3, 2, 7)
        rows = torch.arange(3)
        seen = torch.zeros_like(allowed)
        for s in range(300):
            tok = sample(logits, torch.full((3,), temperature), torch.full((3,), top_k), torch.full((3,), top_p),
                         rows * 1000 + s, torch.zeros(3, 2, dtype=torch.long))
            seen.scatter_(-1, tok[..., None], True)
        assert torch.equal(seen, allowed)
    greedy = sample(logits, torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(3), rows,
                    torch.zeros(3, 2, dtype=torch.long))
    assert torch.equal(greedy, logits.argmax(-1))


def oracle_propose(rt: Runtime, mask: int):
    """A drafter's `propose` that drafts the target's own greedy continuation (never the mask), so
    drafts are accepted whenever the sampled token is the argmax: long acceptances at low temperature.
    It runs the target on the Runtime's target cache at the block's positions, which verify
    rewrites with the same tokens before reading them."""
    def propose(target, block_ids, block_pos, *, cache, **_):
        tcache = rt.state.target_cache.view(block_ids.shape[0], cache.max_len)
        tok, drafts = block_ids[:, :1], []
        for j in range(block_ids.shape[1] - 1):
            logits, _ = target(tok, block_pos[:, j:j + 1], tcache)
            logits[..., mask] = float("-inf")
            tok = logits.argmax(-1)
            drafts.append(tok)
        return torch.cat(drafts, dim=1)
    return propose


@pytest.mark.parametrize("setting, temperature, top_k, top_p", [(0, 0.3, 0, 1.0), (1, 0.5, 3, 0.8),
                                                               (2, 0.7, 2, 0.9)])
def test_sampling_with_often_accepted_drafts_matches_target_sampling(setting, temperature, top_k, top_p):
    """Drafts that are usually right exercise the accept path the random drafter rarely reaches:
    four tokens, so the first round's block slots 0-2 all emit (top-k and top-p together, too);
    each setting draws from its own seeds."""
    hf = tiny_hf_target(seed=7, vocab=5, layers=2)
    hf.model.embed_tokens.weight.data *= 0.5
    target = ours_from_hf(hf)
    drafter = tiny_drafter(target, seed=3, block_size=4)
    mask = drafter.config.mask_token_id
    rt = Runtime(target, drafter, fixed(max_batch=N, max_len=16, batch_buckets=(N,)))
    drafter.propose = oracle_propose(rt, mask)
    rids = [rt.add_request(PROMPT, max_new_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=setting * N + i) for i in range(N)]
    while not all(rt.is_finished(r) for r in rids):
        rt.step()
    records = [rt.pop(r) for r in rids]
    accepted = sum(a - 1 for r in records for a in r.acceptance)
    drafted = sum(len(r.acceptance) for r in records) * (drafter.block_size - 1)
    assert accepted / drafted > 0.3, accepted / drafted
    plain = plain_target_samples(hf, temperature, top_k, top_p, steps=4, exclude=mask, seed=100 + setting)
    p = chi_square_p(Counter(tuple(r.emitted) for r in records), plain)
    assert p > 1e-3, p


def test_relay_under_sampling_changes_drafts_not_tokens(reference_pair):
    """The output law does not depend on drafts, and the draws are a function of (seed, position):
    a seeded request emits the same tokens with a random relay on and off."""
    target, parent = reference_pair
    drafter = random_relay(parent)
    prompts = [c["prompt_ids"] for c in json.loads((FIXTURES / "rounds.json").read_text())["cases"][:4]]
    runs = {}
    for relay in (True, False):
        rt = Runtime(target, drafter, fixed(max_batch=4, max_len=160))
        with relay_off(drafter, not relay):
            rids = [rt.add_request(p, max_new_tokens=48, temperature=0.8, top_p=0.95, seed=21 + i)
                    for i, p in enumerate(prompts)]
            while not all(rt.is_finished(r) for r in rids):
                rt.step()
        runs[relay] = [rt.pop(r) for r in rids]
    assert [r.emitted for r in runs[True]] == [r.emitted for r in runs[False]]
    assert [r.acceptance for r in runs[True]] != [r.acceptance for r in runs[False]], "the relay changed nothing"
