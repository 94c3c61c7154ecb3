"""`bench --suite e2e` on the tiny reference fixture: every method decodes AR greedy's tokens, the
JSON's figures hang together by value, and the plots are PNGs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import struct

import pytest

from dflow_rt.bench import e2e
from dflow_rt.bench.e2e import add_e2e_args, run_e2e
from dflow_rt.bench.report import format_widths, label
from dflow_rt.errors import DflowError
from tests.conftest import FIXTURES

COLUMNS = {"target", "method", "drafter", "mode", "batch", "dtype", "k", "prompts", "calls", "tau",
           "tokens_per_s", "ttft_ms", "acceptance_histogram", "identical", "tokens", "speedup_vs_hf",
           "speedup_vs_ar", "ar_baseline", "bound_share"}


def bench_args(argv: list[str]) -> argparse.Namespace:
    """The bench subcommand's own flags (as `dflow-rt bench` defines them) plus the e2e ones."""
    p = argparse.ArgumentParser()
    for flag in ("--target", "--drafter", "--threads", "--device", "--json"):
        p.add_argument(flag, type=int if flag == "--threads" else str, default=None)
    p.add_argument("--modes", nargs="+", default=None)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    add_e2e_args(p)
    return p.parse_args(argv)


def fixture_args(out, *argv: str) -> argparse.Namespace:
    """The reference fixture pair on token-id prompts (it has no tokenizer), plus `argv`."""
    (out / "prompts.json").write_text(json.dumps([[1, 5, 7, 2, 9, 4, 4, 8], [3, 3, 10, 12, 6], [2, 8, 1]]))
    return bench_args(["--targets", str(FIXTURES / "target"), "--drafters", str(FIXTURES / "drafter"),
                       "--prompt-ids", str(out / "prompts.json"), *argv])


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    args = fixture_args(out, "--prompts", "3", "--max-new-tokens", "12", "--batches", "1", "2",
                        "--modes", "eager", "compile", "--compiler", "aot_eager", "--dtypes", "float32",
                        "--verify-widths", "4", "16", "--threads", "1", "--json", str(out / "e2e.json"),
                        *(["--plots", str(out)] if importlib.util.find_spec("matplotlib") else []))
    run_e2e(args)
    return json.loads((out / "e2e.json").read_text()), out


def test_every_method_decodes_ar_greedy(result):
    data, _ = result
    rows = data["rows"]
    names = {(r["method"], r["mode"], r["batch"], r["dtype"]) for r in rows}
    assert {("hf_generate", "eager", 1, "float32"), ("hf_prompt_lookup", "eager", 1, "float32"),
            ("reference", "eager", 1, "float32")} <= names
    for mode in ("eager", "compile"):
        for batch in (1, 2):
            assert {("ar", mode, batch, "float32"), ("drafter", mode, batch, "float32")} <= names
    assert len(rows) == len(names) == 11 and data["failures"] == data["bf16_mismatches"] == []
    assert all(r["identical"] == 1.0 and r["prompts"] == 3 for r in rows)


def test_columns_hang_together(result):
    data, _ = result
    rows = data["rows"]
    hf = next(r for r in rows if r["method"] == "hf_generate")
    sweep = data["targets"][str(FIXTURES / "target")]["verify_width_sweep"]["drafter"]
    for r in rows:
        assert COLUMNS <= set(r), label(r)
        block = 16 if r["method"] in ("drafter", "reference", "hf_prompt_lookup") else 1
        assert 1.0 <= r["tau"] <= block
        assert r["tokens_per_s"] > 0 and r["ttft_ms"] > 0
        assert r["speedup_vs_hf"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
        base = r["ar_baseline"]
        ar = next(a for a in rows if a["method"] == "ar" and (a["mode"], a["batch"], a["dtype"]) ==
                  (base["mode"], base["batch"], base["dtype"]))
        assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / ar["tokens_per_s"])
        if r["method"] == "ar" or r["method"] == "drafter":
            assert (base["mode"], base["batch"], base["dtype"]) == (r["mode"], r["batch"], r["dtype"])
        if r["method"] == "drafter":
            speeds = sweep[str(r["batch"])]
            assert set(speeds) == {"4", "16"} and all(v > 0 for v in speeds.values())
            assert r["k"] == int(max(speeds, key=speeds.get))  # the fastest k of the sweep
        # every round emits at least one token; the rounds together emitted every token but prefill's
        assert sum(n * c for n, c in enumerate(r["acceptance_histogram"], 1)) >= r["tokens"] - r["prompts"]
    assert all(r["acceptance_histogram"] == [r["tokens"] - r["prompts"]] for r in rows if r["method"] == "ar")
    # the bandwidth bound: every weight once per token (the fixture's embedding is untied: one row of it)
    from safetensors.torch import load_file

    info = data["targets"][str(FIXTURES / "target")]
    weights = load_file(FIXTURES / "target" / "model.safetensors")
    read = sum(w.numel() * w.element_size() for name, w in weights.items() if "embed_tokens" not in name)
    assert "lm_head.weight" in weights and info["bytes_per_token"]["float32"] == read
    bound = info["read_gbps"] * 1e9 / read
    assert info["bound_tokens_per_s"]["float32"] == pytest.approx(bound)
    for r in rows:
        assert r["bound_share"] == (pytest.approx(r["tokens_per_s"] / bound) if r["batch"] == 1 else None)
    assert any("read bandwidth" in n and "bound" in n for n in data["notes"])


def test_plots_are_pngs(result):
    pytest.importorskip("matplotlib")  # the `bench` extra
    _, out = result
    for name in ("acceptance", "tokens_per_s", "speedup"):
        head = (out / f"e2e_{name}.png").read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
        width, height = struct.unpack(">II", head[16:24])
        assert width > 400 and height > 200


def test_a_differing_output_fails_loudly(monkeypatch, tmp_path, capsys):
    """One reference call emitting a wrong last token must fail the run and name its row."""
    real = e2e.reference_runner

    def corrupted(*args, **kwargs):
        run = real(*args, **kwargs)

        def wrong(prompts, max_new):
            out = run(prompts, max_new)
            out.outputs[0][-1] += 1
            return out

        return wrong

    monkeypatch.setattr(e2e, "reference_runner", corrupted)
    args = fixture_args(tmp_path, "--prompts", "2", "--max-new-tokens", "6", "--batches", "1", "--modes",
                        "eager", "--verify-widths", "16", "--threads", "1", "--json", str(tmp_path / "e2e.json"))
    with pytest.raises(DflowError, match="NOT LOSSLESS: 1 float32 rows"):
        run_e2e(args)
    assert "!! 0.0 % !!" in capsys.readouterr().out
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert data["failures"] == [f"{FIXTURES / 'target'}: reference drafter b1 fp32"]


def test_prompts_come_from_the_suite_asked_for():
    """The drafters' tau differs by suite, so the bench can time any held-out suite; HumanEval by default."""
    from dflow_rt.data.prompts import suite_prompts
    from dflow_rt.models.bundled import target_dir
    from dflow_rt.tokenizer import load_tokenizer, stop_token_ids

    path = target_dir(None)
    tokenizer = load_tokenizer(path)
    for suite in ("code", "math", "chat"):
        argv = [] if suite == "code" else ["--prompt-suite", suite]
        prompts, stops = e2e.load_prompts(path, bench_args(["--prompts", "2", *argv]))
        assert prompts == suite_prompts(tokenizer, suite, 2) and stops == stop_token_ids(tokenizer)


def test_every_width_times_each_k_without_a_sweep(tmp_path):
    """--every-width: a drafted row (and its fallback row) per k given, none chosen by a sweep."""
    args = fixture_args(tmp_path, "--prompts", "2", "--max-new-tokens", "6", "--batches", "1", "--modes",
                        "eager", "--verify-widths", "2", "4", "--every-width", "--ar-fallback", "--threads", "1",
                        "--no-llama-cpp", "--json", str(tmp_path / "e2e.json"))
    data = run_e2e(args)
    drafted = sorted((r["method"], r["k"]) for r in data["rows"] if r["method"].startswith("drafter"))
    assert drafted == [("drafter", 2), ("drafter", 4), ("drafter+fallback", 2), ("drafter+fallback", 4)]
    assert data["targets"][str(FIXTURES / "target")]["verify_width_sweep"] == {"drafter": {1: {2: None, 4: None}}}
    assert "| drafter | 1 | not swept (--every-width) | 2 4 |" in format_widths(data)
    assert data["failures"] == [] and all(r["identical"] == 1.0 for r in data["rows"])
