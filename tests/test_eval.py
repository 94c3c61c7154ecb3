"""eval-tau: the held-out suites, tau through the Runtime, and the relay diagnostics."""

import json

import pytest

import dflow_rt
import dflow_rt.oracle
from dflow_rt.commands.main import main
from dflow_rt.data.prompts import suite_texts
from dflow_rt.eval.diagnose import relay_diagnostics, summarize
from dflow_rt.eval.tau import TauResult, measure_tau, sem
from dflow_rt.models.drafter import with_relay
from dflow_rt.oracle import RoundTrace
from tests.conftest import FIXTURES
from tests.helpers import random_relay

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]


def test_suites_are_fixed_and_held_out():
    code = suite_texts("code")
    assert len(code) == 164 and code[0].startswith("from typing import List")  # HumanEval, in task order
    assert suite_texts("code", 5) == code[:5]
    assert suite_texts("math", 7) == suite_texts("math")[:7]
    from dflow_rt.data.corpus import heldout_chat_prompts

    assert len(suite_texts("chat")) == len(heldout_chat_prompts()) > 50
    with pytest.raises(dflow_rt.InputError):
        suite_texts("poetry")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tau_through_runtime_matches_the_reference_round(reference_pair, temperature):
    target, parent = reference_pair
    drafter = random_relay(parent)
    prompts = [c["prompt_ids"] for c in CASES[:5]]
    result = measure_tau(target, drafter, prompts, "t", temperature, max_new_tokens=40, batch=2)
    if temperature == 0:
        refs = [dflow_rt.oracle.generate(target, drafter, p, max_new_tokens=40).acceptance_lengths for p in prompts]
        assert result.acceptance == refs
    # Sampling is seeded per prompt: the same prompts give the same rounds again, at another batch size too.
    again = measure_tau(target, drafter, prompts, "t", temperature, max_new_tokens=40, batch=4)
    assert again.acceptance == result.acceptance


def test_tau_at_a_verify_width_matches_the_reference_round_at_that_width(reference_pair):
    """--verify-width k: each round verifies k - 1 drafted tokens, as the reference round with that width."""
    target, drafter = reference_pair
    prompts = [c["prompt_ids"] for c in CASES[:3]]
    result = measure_tau(target, drafter, prompts, "t", 0.0, max_new_tokens=40, batch=2, verify_width=3)
    cfg = dflow_rt.RuntimeConfig(verify_width=3)
    refs = [dflow_rt.oracle.generate(target, drafter, p, max_new_tokens=40, config=cfg).acceptance_lengths
            for p in prompts]
    assert result.acceptance == refs and max(max(a) for a in refs) <= 3
    assert refs != [dflow_rt.oracle.generate(target, drafter, p, max_new_tokens=40).acceptance_lengths
                    for p in prompts]


def test_tau_statistics():
    r = TauResult(4, [[1, 4, 2], [3]])
    assert r.per_prompt == [pytest.approx(7 / 3), 3.0]
    assert r.tau == pytest.approx((7 / 3 + 3) / 2)  # prompts weigh the same, not rounds
    assert r.histogram() == [1, 1, 1, 1]
    assert r.position_acceptance() == [0.75, 0.5, 0.25]  # slot k accepted when a round emits > k tokens
    assert sem([1.0, 3.0]) == pytest.approx(1.0)
    s = r.summary()
    assert s["rounds"] == 4 and s["prompts"] == 2


def test_diagnostics_count_what_they_claim():
    B = 4
    traces = [[
        RoundTrace([5, 1, 2, 3], [1, 9, 7, 6], accepted=1, drafts_without_relay=[1, 2, 3]),
        # after a=1: the target guessed 7 for the token after the bonus 9; truth (verified[0]) is 7
        RoundTrace([9, 8, 0, 0], [7, 1, 1, 1], accepted=0, drafts_without_relay=[7, 0, 0]),
        # after a=0: target guessed 1; truth 2; the drafter's slot 1 (2) was right; relay changed slot 1 and 3
        RoundTrace([7, 2, 3, 4], [2, 3, 4, 5], accepted=3, drafts_without_relay=[5, 3, 0]),
        RoundTrace([5, 6, 6, 6], [6, 0, 0, 0], accepted=1, drafts_without_relay=[6, 6, 6]),  # after a=3: skipped
    ]]
    assert len(traces[0][0].block) == B
    d = summarize(traces)
    assert d["rounds_after_rejection"] == 2
    assert d["target_acc_at_rejected"] == 0.5 and d["drafter_slot1_acc"] == 0.5
    assert d["relay_changes_round"] == 1.0
    assert d["relay_changes_slot"] == pytest.approx((1 + 2) / (2 + 3))


def test_diagnostics_on_real_rounds(reference_pair):
    target, parent = reference_pair
    prompts = [c["prompt_ids"] for c in CASES[:3]]
    off = relay_diagnostics(target, with_relay(parent, relay_hidden=32), prompts, 48)
    on = relay_diagnostics(target, random_relay(parent), prompts, 48)
    assert off["relay_changes_round"] == 0.0  # a zero-init relay never changes a draft
    assert on["relay_changes_round"] > 0
    assert 0 <= on["target_acc_at_rejected"] <= 1 and on["rounds_after_rejection"] > 0


def test_cli_eval_tau_json(reference_pair, capsys, monkeypatch):
    target_dir, drafter_dir = FIXTURES / "target", FIXTURES / "drafter"
    monkeypatch.setattr("dflow_rt.data.prompts.suite_texts",
                        lambda suite, limit=None, chat=None: ["a b c", "x y z w"][:limit])
    monkeypatch.setattr("dflow_rt.tokenizer.load_tokenizer", lambda path: FakeTokenizer())
    assert main(["eval-tau", "--target", str(target_dir), "--drafter", str(drafter_dir), "--suite", "math",
                 "--limit", "2", "--max-new-tokens", "24", "--json", "--diagnostics"]) == 0
    report = json.loads(capsys.readouterr().out)
    entry = report["suites"]["math"]
    target, drafter = reference_pair
    refs = [dflow_rt.oracle.generate(target, drafter, FakeTokenizer().encode(t), max_new_tokens=24) for t in
            ["a b c", "x y z w"]]
    assert entry["per_prompt_tau"] == [round(r.tau, 4) for r in refs]
    assert sum(entry["histogram"]) == entry["rounds"] == sum(len(r.acceptance_lengths) for r in refs)
    assert "target_acc_at_rejected" in entry["diagnostics"] and report["relay"] is False


class FakeTokenizer:
    """Whitespace words as ids: the fixture models come without a tokenizer."""

    def encode(self, text, add_special_tokens=False):
        return [3 + sum(map(ord, w)) % 18 for w in text.split()]

    eos_token_id, unk_token_id = 1, None

    def convert_tokens_to_ids(self, token):
        return None
