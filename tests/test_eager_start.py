"""Cold starts that answer: on an empty compile cache an `eager_start` Runtime decodes at once on eager
rounds and switches to the compiled rounds between requests once they are on disk; `generate` answers
and leaves the build to a background process. Tokens are the oracle's throughout."""

from __future__ import annotations

import json

import pytest

import dflow_rt
import dflow_rt.commands.main as commands_main
import dflow_rt.oracle
from dflow_rt import Runtime, RuntimeConfig
from dflow_rt.commands.main import main
from dflow_rt.models.bundled import ASSETS
from tests.test_runtime import CASES


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLOW_RT_CACHE", str(tmp_path))
    return tmp_path / "compiled"


def config(**kw) -> RuntimeConfig:
    """One compiled graph (batch 1, greedy, the whole block), so that the test compiles once."""
    return RuntimeConfig(**{"max_batch": 1, "max_len": 128, "length_buckets": (64,), "mode": "compile",
                            "verify_width": None, "ar_fallback": False, "lookup": False, "sampling": False, **kw})


def test_an_eager_start_answers_now_and_switches_to_compiled_rounds_once_on_disk(reference_pair, empty_cache):
    target, drafter = reference_pair
    prompts = [c["prompt_ids"] for c in CASES[:2]]
    want = [dflow_rt.oracle.generate(target, drafter, p, max_new_tokens=24).token_ids for p in prompts]
    rt = Runtime(target, drafter, config(eager_start=True))
    assert rt.compile_pending and not empty_cache.exists()  # nothing compiled, nothing written
    rid = rt.add_request(prompts[0], max_new_tokens=24)
    rt.step()
    assert not rt.compile_rounds()  # a row is live: no switch under a running request
    while not rt.is_finished(rid):
        rt.step()
    assert rt.pop(rid).emitted == want[0] and rt.compile_pending

    builder = Runtime(target, drafter, config())  # what the background process does: compile, save
    assert not builder.compile_pending and not builder.compile_cache_hit and empty_cache.exists()
    assert rt._compile_cache().dir == builder._compile_cache().dir
    rt._asked = 0.0  # the disk is asked at most once a second
    assert rt._compiled_on_disk()
    rt._asked = 0.0
    assert rt.generate([prompts[1]], max_new_tokens=24) == [want[1]]
    assert not rt.compile_pending and rt.compile_cache_hit  # switched between requests, from the disk
    assert rt.generate([prompts[0]], max_new_tokens=24) == [want[0]]


def test_a_cold_generate_answers_eagerly_and_starts_one_background_build(empty_cache, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(commands_main, "build_in_background", lambda argv, meanwhile: started.append(argv))
    argv = ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--mode", "compile", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    target = dflow_rt.load_target(ASSETS / "target")
    assert out["compile_pending"] and started == [argv] and not empty_cache.exists()
    assert out["token_ids"] == dflow_rt.oracle.generate(target, None, out["prompt_ids"], max_new_tokens=24).token_ids
