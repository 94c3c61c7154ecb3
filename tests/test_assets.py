"""The bundled models load in dflow-rt and in transformers, and agree."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dflow_rt

ASSETS = Path(dflow_rt.__file__).parent / "assets"


def test_bundled_target_matches_transformers():
    ours = dflow_rt.load_target(ASSETS / "target")
    hf = AutoModelForCausalLM.from_pretrained(ASSETS / "target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ASSETS / "target")
    ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b\n", add_special_tokens=False)])
    with torch.no_grad():
        logits, _ = ours(ids, torch.arange(ids.shape[1])[None])
        torch.testing.assert_close(logits, hf(ids).logits, atol=1e-4, rtol=0)
    assert tok.convert_tokens_to_ids("<|MASK|>") < ours.config.vocab_size
