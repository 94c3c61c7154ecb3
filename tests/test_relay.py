"""DFlow relay: slot mapping, boundary correction, zero-init equivalence, buffer reuse."""

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dflow_rt
import dflow_rt.oracle
from dflow_rt.models.drafter import relay_off, with_relay
from dflow_rt.models.relay import VerifyRecord, shift_to_slots
from tests.conftest import FIXTURES
from tests.helpers import fixed, ours_from_hf, random_relay, tiny_drafter, tiny_hf_target

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]


@settings(max_examples=40)
@given(B=st.integers(2, 16), data=st.data())
def test_shift_to_slots_matches_definition(B, data):
    batch = data.draw(st.integers(1, 3))
    accepted = torch.tensor([data.draw(st.integers(0, B - 1)) for _ in range(batch)])
    features = torch.randn(batch, B, 5)
    shifted, valid = shift_to_slots(features, accepted)
    for b in range(batch):
        a = int(accepted[b])
        start_next = a + 1  # next round's start, relative to this round's start
        for p in range(a + 1, B):  # rejected positions of this round
            j = p - start_next + 1
            assert valid[b, j] and torch.equal(shifted[b, j], features[b, p])
        assert int(valid[b].sum()) == B - 1 - a and not valid[b, 0]


def test_relay_vectors_follow_the_formula(reference_pair):
    target, parent = reference_pair
    drafter = random_relay(parent, seed=1)
    B, E = 16, target.embed_tokens
    buf = drafter.new_verify_record(1)
    feats = torch.randn(1, B, drafter.fc.weight.shape[1])
    block, verified = torch.randint(0, 23, (1, B)), torch.randint(0, 23, (1, B))
    a = 5
    buf.write(torch.tensor([0]), feats, block, verified, torch.tensor([a]))
    got, valid = drafter.relay_vectors(target, buf, torch.tensor([0]))
    got = got[0]
    assert valid[0].tolist() == [1 <= j <= B - 1 - a for j in range(B)]
    sd = drafter.state_dict()
    for j in range(B):
        if not 1 <= j <= B - 1 - a:
            assert torch.all(got[j] == 0)
            continue
        x = feats[0, a + j] @ sd["fc.weight"].T
        u = x * torch.rsqrt(x.pow(2).mean() + 1e-6) * sd["hidden_norm.weight"]
        c, d = E.weight[verified[0, a]], E.weight[block[0, a + 1]]
        hid = F.silu(torch.cat([c, d, u]) @ sd["relay.fc1.weight"].T + sd["relay.fc1.bias"])
        scale, shift = (hid @ sd["relay.fc2.weight"].T + sd["relay.fc2.bias"]).chunk(2)
        expected = scale * (u - u.mean()) / torch.sqrt(u.var(unbiased=False) + 1e-5) + shift
        torch.testing.assert_close(got[j], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("relay_input", ["mask_embedding", "kv"])
def test_converted_drafter_drafts_exactly_like_its_parent(reference_pair, relay_input):
    target, parent = reference_pair
    converted = with_relay(parent, relay_hidden=32, seed=3, relay_input=relay_input)
    assert converted.relay is not None and converted.use_relay
    for case in CASES:
        a = dflow_rt.oracle.generate(target, parent, case["prompt_ids"], max_new_tokens=case["max_new_tokens"])
        b = dflow_rt.oracle.generate(target, converted, case["prompt_ids"], max_new_tokens=case["max_new_tokens"])
        assert a.token_ids == b.token_ids and a.acceptance_lengths == b.acceptance_lengths


@pytest.mark.parametrize("relay_input", ["mask_embedding", "kv"])
def test_relay_changes_drafts_but_not_output(reference_pair, relay_input):
    target, parent = reference_pair
    drafter = random_relay(parent, relay_input=relay_input)
    changed = 0
    for case in CASES:
        on = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=48)
        with relay_off(drafter):
            off = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=48)
        assert on.token_ids == off.token_ids == case["output_ids"][:48]
        changed += on.acceptance_lengths != off.acceptance_lengths
    assert changed > 0, "a random relay should change some drafts"


def test_verify_record_keeps_its_storage(reference_pair):
    target, parent = reference_pair
    drafter = random_relay(parent)
    seen = []
    original = drafter.propose

    def spy(*args, **kwargs):
        buf = args[-1] if isinstance(args[-1], VerifyRecord) else kwargs["relay"]
        seen.append((buf.features.data_ptr(), buf.accepted.data_ptr(), buf.features.sum().item()))
        return original(*args, **kwargs)

    drafter.propose = spy
    out = dflow_rt.oracle.generate(target, drafter, CASES[0]["prompt_ids"], max_new_tokens=40)
    assert len(seen) == len(out.acceptance_lengths) > 3
    assert len({s[:2] for s in seen}) == 1, "the verify record must be written in place"
    assert len({s[2] for s in seen[1:]}) > 1, "the verify record must be rewritten every round"


@settings(max_examples=25)
@given(seed=st.integers(0, 10_000), vocab=st.integers(3, 10), block_size=st.sampled_from([2, 4, 8, 16]),
       prompt_len=st.integers(1, 16), max_new_tokens=st.integers(1, 48),
       relay_input=st.sampled_from(["mask_embedding", "kv"]))
def test_dflow_is_lossless(seed, vocab, block_size, prompt_len, max_new_tokens, relay_input):
    from tests.helpers import hf_greedy

    hf = tiny_hf_target(seed, vocab=vocab, layers=2)
    target = ours_from_hf(hf)
    drafter = random_relay(tiny_drafter(target, seed), relay_hidden=16, seed=seed, relay_input=relay_input)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    out = dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens, config=fixed(block_size=block_size))
    assert out.token_ids == hf_greedy(hf, prompt, max_new_tokens, suppress=drafter.config.mask_token_id)


def test_convert_command_writes_a_loadable_dflow_checkpoint(reference_pair, tmp_path):
    from safetensors import safe_open

    from dflow_rt.commands.main import main

    target, parent = reference_pair
    assert parent.relay is None and not parent.use_relay, "a DFlash checkpoint loads with the relay off"
    out = tmp_path / "dflow"
    assert main(["convert", "--from-dflash", str(FIXTURES / "drafter"), "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflow_config"]["relay_hidden"] == 64 and cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert torch.count_nonzero(f.get_tensor("relay.fc2.weight")) == 0
    assert {k for k in keys if k.startswith("relay.")} == {
        "relay.fc1.weight", "relay.fc1.bias", "relay.fc2.weight", "relay.fc2.bias"}
    converted = dflow_rt.load_drafter(out, target)
    assert converted.use_relay
    for case in CASES[:3]:
        a = dflow_rt.oracle.generate(target, parent, case["prompt_ids"], max_new_tokens=32)
        b = dflow_rt.oracle.generate(target, converted, case["prompt_ids"], max_new_tokens=32)
        assert a.acceptance_lengths == b.acceptance_lengths and a.token_ids == b.token_ids
    assert main(["convert", "--from-dflash", str(out), "--out", str(tmp_path / "again")]) == 2
    kv = tmp_path / "dflow-kv"
    assert main(["convert", "--from-dflash", str(FIXTURES / "drafter"), "--out", str(kv), "--relay-input", "kv"]) == 0
    assert json.loads((kv / "config.json").read_text())["dflow_config"]["relay_input"] == "kv"
    converted = dflow_rt.load_drafter(kv, target)
    assert converted.config.relay_input == "kv"
    b = dflow_rt.oracle.generate(target, converted, CASES[0]["prompt_ids"], max_new_tokens=32)
    assert b.acceptance_lengths == dflow_rt.oracle.generate(target, parent, CASES[0]["prompt_ids"],
                                                               max_new_tokens=32).acceptance_lengths
