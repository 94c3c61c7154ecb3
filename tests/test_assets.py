"""The bundled models load in dflow-rt and in transformers, and agree."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dflow_rt
import dflow_rt.oracle
from dflow_rt.commands.main import main

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


def test_bundled_drafters_are_lossless_and_accept_drafts(capsys):
    """`generate` with no model arguments runs the bundled target with a bundled drafter, and emits
    exactly the bundled target's own greedy decoding; both bundled drafters really draft (tau well above 1)."""
    import json

    from dflow_rt.commands.main import main

    target = dflow_rt.load_target(ASSETS / "target")
    assert main(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "48", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == dflow_rt.oracle.generate(target, None, out["prompt_ids"], max_new_tokens=48).token_ids
    from dflow_rt.data.prompts import suite_prompts
    from dflow_rt.tokenizer import load_tokenizer

    maths = suite_prompts(load_tokenizer(ASSETS / "target"), "math", 3)
    for name in ("dflash", "dflow"):
        drafter = dflow_rt.load_drafter(ASSETS / name, target)
        assert (drafter.relay is not None) == (name == "dflow") and drafter.block_size == 16
        spec = dflow_rt.oracle.generate(target, drafter, out["prompt_ids"], max_new_tokens=48)
        assert spec.token_ids == out["token_ids"]
        taus = [dflow_rt.oracle.generate(target, drafter, p, max_new_tokens=48).tau for p in maths]
        assert sum(taus) / len(taus) > 1.5  # held-out word problems (a drafter that never hits: 1.0)


@pytest.mark.parametrize("width", [None, 2])
def test_bench_cli_reports_every_phase(tmp_path, monkeypatch, width):
    from dflow_rt.bench import runtime as bench_runtime

    fixtures = Path(__file__).parent / "fixtures" / "dflash_reference"
    report = tmp_path / "bench.json"
    extra = [] if width is None else ["--verify-width", str(width)]
    built, real = [], bench_runtime.Runtime  # every Runtime the bench builds verifies `width` positions

    def runtime(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(bench_runtime, "Runtime", runtime)
    assert main(["bench", "--target", str(fixtures / "target"), "--drafter", str(fixtures / "drafter"),
                 "--modes", "eager", "--batches", "2", "--rounds", "3", "--json", str(report), *extra]) == 0
    result = json.loads(report.read_text())
    rows = result["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("eager", 2)] and result["verify_width"] == width
    assert {"tokens_per_s", "draft_ms", "verify_ms", "commit_ms", "host_frac"} <= rows[0].keys()
    assert len(built) == 2 and all(rt.plan.widths == {2: width or 16} for rt in built)  # end to end, phases


def test_bundled_names_resolve(tmp_path, monkeypatch):
    from dflow_rt.models import bundled

    assert bundled.target_dir(None) == ASSETS.resolve() / "target" and bundled.drafter_dir(None) is None
    assert bundled.drafter_dir("dflow") == ASSETS.resolve() / "dflow"
    assert bundled.drafter_dir(str(tmp_path)) == tmp_path  # anything else is a directory
    assert bundled.drafter_dir("dflash", "smollm2") == ASSETS.resolve() / "smollm2" / "dflash"
    assert bundled.drafter_dir("dflash", str(ASSETS / "target")) == ASSETS.resolve() / "dflash"
    with pytest.raises(dflow_rt.InputError, match="no bundled dflow drafter for --target /some/dir"):
        bundled.drafter_dir("dflow", "/some/dir")
    # a fetched model is known by its manifest wherever it lives (`fetch-model smollm2 --out DIR`)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "fetched.json").write_text(json.dumps({"name": "smollm2", "files": {"config.json": 2}}))
    assert bundled.drafter_dir("dflow", str(tmp_path)) == ASSETS.resolve() / "smollm2" / "dflow"
    monkeypatch.setattr(bundled, "ASSETS", tmp_path)
    with pytest.raises(dflow_rt.InputError, match="bundled dflash drafter is missing"):
        bundled.drafter_dir("dflash")


def test_bundled_weights_stay_small():
    """Every model the package carries is stored in bf16, within the 60 MB the wheel may spend on weights."""
    from safetensors.torch import load_file

    weights = sorted(ASSETS.rglob("*.safetensors"))
    assert len(weights) == 5 and sum(p.stat().st_size for p in weights) <= 60e6
    for p in weights:
        assert {t.dtype for t in load_file(p).values()} == {torch.bfloat16}, p

