"""The reference round: exactly the DFlash reference's outputs, and exactly target greedy."""

import json
import random

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import dflow_rt
import dflow_rt.oracle
from tests.conftest import FIXTURES, REFERENCE_FIXTURES, load_pair
from tests.helpers import fixed, hf_greedy, ours_from_hf, tiny_drafter, tiny_hf_target

ROUNDS = json.loads((FIXTURES / "rounds.json").read_text())


@pytest.mark.parametrize("fixture", REFERENCE_FIXTURES, ids=lambda p: p.name)
def test_rounds_match_reference_implementation(fixture):
    target, drafter = load_pair(fixture)
    rounds = json.loads((fixture / "rounds.json").read_text())
    assert drafter.block_size == rounds["block_size"] and drafter.config.mask_token_id == rounds["mask_token_id"]
    mask, hf = drafter.config.mask_token_id, transformers.AutoModelForCausalLM.from_pretrained(fixture / "target")
    for case in rounds["cases"]:
        # The public implementation lets the target choose the mask token (an ordinary id in these tiny
        # models): with `emit_mask_token` the round is exactly its round.
        out = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=case["max_new_tokens"],
                                          config=fixed(emit_mask_token=True))
        if mask in case["output_ids"]:  # by default the mask token is never chosen: the target's next choice
            default = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"],
                                                  max_new_tokens=case["max_new_tokens"])
            assert default.token_ids == hf_greedy(hf, case["prompt_ids"], case["max_new_tokens"], suppress=mask)
            assert mask not in default.token_ids
        assert out.token_ids == case["output_ids"]
        n = len(out.acceptance_lengths)
        # The reference always finishes a round and cuts afterwards, so it may run one more.
        assert out.acceptance_lengths[: n - 1] == case["acceptance_lengths"][: n - 1]
        assert n in (len(case["acceptance_lengths"]), len(case["acceptance_lengths"]) - 1)
        assert out.acceptance_lengths[-1] <= case["acceptance_lengths"][n - 1]
    B = rounds["block_size"]
    assert {a for c in rounds["cases"] for a in c["acceptance_lengths"]} >= {1, B}, "fixture should vary acceptance"


def test_prompt_as_tensor_and_autoregressive_mode(reference_pair):
    target, drafter = reference_pair
    case = ROUNDS["cases"][0]
    as_tensor = dflow_rt.oracle.generate(target, drafter, torch.tensor(case["prompt_ids"]), max_new_tokens=20)
    plain = dflow_rt.oracle.generate(target, None, case["prompt_ids"], max_new_tokens=20)
    one = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], 20, config=fixed(block_size=1))
    assert as_tensor.token_ids == plain.token_ids == one.token_ids == case["output_ids"][:20]
    assert plain.acceptance_lengths == one.acceptance_lengths == [1] * 19


class OracleDrafter:
    """Drafts the true greedy continuation, corrupting each slot with probability `noise`.

    Long acceptances and rejections at every slot exercise commit and carry bookkeeping
    that a random drafter rarely reaches.
    """

    def __init__(self, real: dflow_rt.Drafter, prompt_len: int, continuation: list[int], noise: float, seed: int):
        self.real, self.prompt_len, self.continuation = real, prompt_len, continuation
        self.noise, self.rng = noise, random.Random(seed)
        self.config, self.block_size, self.target_layer_ids = real.config, real.block_size, real.target_layer_ids

    def new_cache(self, batch, max_len):
        return self.real.new_cache(batch, max_len)

    def new_verify_record(self, batch, block_size):
        return self.real.new_verify_record(batch, block_size)

    def propose(self, target, block_ids, block_pos, *, cache, ctx_feat=None, ctx_pos=None, rows=None, relay=None):
        first = int(block_pos[0, 1]) - self.prompt_len
        vocab = self.config.vocab_size
        drafts = []
        for i in range(first, first + block_ids.shape[1] - 1):
            tok = self.continuation[i] if i < len(self.continuation) else 0
            if self.rng.random() < self.noise:
                tok = (tok + 1 + self.rng.randrange(vocab - 1)) % vocab
            drafts.append(tok)
        return torch.tensor([drafts])


@settings(max_examples=60)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(3, 12),
    layers=st.integers(2, 3),
    tied=st.booleans(),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    prompt_len=st.integers(1, 20),
    max_new_tokens=st.integers(1, 64),
    use_stop=st.booleans(),
    drafter_kind=st.sampled_from(["random", "oracle", "noisy-oracle"]),
)
def test_lossless_against_target_greedy(seed, vocab, layers, tied, block_size, prompt_len, max_new_tokens,
                                        use_stop, drafter_kind):
    hf = tiny_hf_target(seed, vocab=vocab, layers=layers, tied=tied)
    target = ours_from_hf(hf)
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    stops = [rng.randrange(vocab)] if use_stop else []
    mask = vocab - 1  # tiny_drafter's mask token: never emitted beside a drafter
    expected = hf_greedy(hf, prompt, max_new_tokens, stops, suppress=mask)
    drafter = tiny_drafter(target, seed, layer_ids=tuple(range(layers))[-2:])
    if drafter_kind != "random":
        full = hf_greedy(hf, prompt, max_new_tokens + block_size, suppress=mask)
        drafter = OracleDrafter(drafter, prompt_len, full, 0.0 if drafter_kind == "oracle" else 0.3, seed)
    out = dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens, stops, fixed(block_size=block_size))
    assert out.token_ids == expected
    assert all(1 <= a <= block_size for a in out.acceptance_lengths)
    assert sum(out.acceptance_lengths) >= len(out.token_ids) - 1
    if drafter_kind == "oracle" and not stops:
        assert all(a == block_size for a in out.acceptance_lengths[:-1])
