"""Cold starts that answer: on an empty compile cache `generate` answers from eager rounds and leaves the
build to a background process (the Runtime's switch to compiled rounds once they are on disk is tested
in tests/test_runtime_compile_cache.py, beside the compile it needs)."""

from __future__ import annotations

import json

import pytest

import dflow_rt
import dflow_rt.commands.main as commands_main
import dflow_rt.oracle
from dflow_rt.commands.main import main
from dflow_rt.models.bundled import ASSETS


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLOW_RT_CACHE", str(tmp_path))
    return tmp_path / "compiled"


def test_a_cold_generate_answers_eagerly_and_starts_one_background_build(empty_cache, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(commands_main, "build_in_background", lambda argv, meanwhile: started.append(argv))
    argv = ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--mode", "compile", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    target = dflow_rt.load_target(ASSETS / "target")
    assert out["compile_pending"] and started == [argv] and not empty_cache.exists()
    assert out["token_ids"] == dflow_rt.oracle.generate(target, None, out["prompt_ids"], max_new_tokens=24).token_ids
