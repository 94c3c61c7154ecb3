"""`dflow_rt.generate` runs through the Runtime: the reference round's tokens and acceptance lengths,
sampling settings passed on, and a fault raised as RequestError rather than decoded."""

import json

import pytest

import dflow_rt
import dflow_rt.oracle
from dflow_rt import RequestError, RuntimeConfig
from tests.conftest import FIXTURES

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]


def test_generate_emits_the_reference_rounds(reference_pair):
    target, drafter = reference_pair
    for case in CASES[:3]:
        ours = dflow_rt.generate(target, drafter, case["prompt_ids"], max_new_tokens=40)
        ref = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=40)
        assert ours.token_ids == ref.token_ids
        assert ours.acceptance_lengths == ref.acceptance_lengths and ours.tau == ref.tau
        assert ours.first_step_tokens >= 1 and ours.decode_seconds >= 0
    plain = dflow_rt.generate(target, None, CASES[0]["prompt_ids"], max_new_tokens=20)
    assert plain.token_ids == dflow_rt.oracle.generate(target, None, CASES[0]["prompt_ids"], 20).token_ids
    config = RuntimeConfig(mode="eager", verify_width=3, emit_mask_token=True)
    emitting = dflow_rt.generate(target, drafter, CASES[0]["prompt_ids"], 40, config=config)
    assert emitting.token_ids == dflow_rt.oracle.generate(target, drafter, CASES[0]["prompt_ids"], 40,
                                                             config=config).token_ids
    assert max(emitting.acceptance_lengths) <= 3


def test_generate_samples_as_a_runtime_does(reference_pair):
    target, drafter = reference_pair
    prompt, kw = CASES[1]["prompt_ids"], {"temperature": 0.9, "top_k": 5, "seed": 7}
    rt = dflow_rt.Runtime(target, drafter, RuntimeConfig(max_batch=1, max_len=160, mode="eager",
                                                         verify_width=None))
    assert dflow_rt.generate(target, drafter, prompt, 30, **kw).token_ids == rt.generate([prompt], max_new_tokens=30,
                                                                                          **kw)[0]


def test_generate_raises_a_fault(reference_pair):
    """A target whose logits go NaN: the reference round decodes garbage, generate raises."""
    target, drafter = reference_pair
    hook = target.model.layers[0].register_forward_hook(lambda module, inputs, out: out.fill_(float("nan")))
    try:
        with pytest.raises(RequestError, match="NaN"):
            dflow_rt.generate(target, drafter, CASES[0]["prompt_ids"], max_new_tokens=20)
        assert len(dflow_rt.oracle.generate(target, drafter, CASES[0]["prompt_ids"], 20).token_ids) == 20
    finally:
        hook.remove()
