"""Cold starts that answer: on an empty compile cache `generate` answers from eager rounds and leaves the
build to a background process (the Runtime's switch to compiled rounds once they are on disk is tested
in tests/test_runtime_compile_cache.py, beside the compile it needs)."""

from __future__ import annotations

import json

import pytest

import dflow_rt
import dflow_rt.commands.main as commands_main
import dflow_rt.oracle
from dflow_rt import Runtime, RuntimeConfig
from dflow_rt.commands.main import main
from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.models.bundled import ASSETS, drafter_dir


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


def test_a_cold_start_answers_before_the_kernels_are_built_and_moves_onto_them(monkeypatch, tmp_path, capsys):
    """Where the C++ kernels are not built yet, `generate` answers on torch's ops without building them
    (the background build does), and a Runtime moves onto them between requests once they are on disk."""
    if not cpu_ops.enabled():
        pytest.skip("the C++ kernels do not run here")
    built = cpu_ops.library_path()  # this process's build, loaded: what the background build would write
    monkeypatch.setattr(cpu_ops, "_ready", None)  # a fresh process on a machine where nothing is built
    monkeypatch.setattr(cpu_ops, "_deferred", False)
    monkeypatch.setenv("DFLOW_RT_CACHE", str(tmp_path))
    said = []
    monkeypatch.setattr(commands_main, "build_in_background", lambda argv, meanwhile: said.append(meanwhile))
    assert main(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert cpu_ops.deferred() and not (tmp_path / "kernels").exists() and "torch's ops" in said[0]
    target = dflow_rt.load_target(ASSETS / "target")
    drafter = dflow_rt.load_drafter(drafter_dir("dflash"), target)
    prompt = out["prompt_ids"]
    assert out["token_ids"] == dflow_rt.oracle.generate(target, None, prompt, max_new_tokens=24).token_ids

    rt = Runtime(target, drafter, RuntimeConfig(max_batch=1, max_len=128, mode="compile", eager_start=True))
    assert rt.kernels_pending and rt.compile_pending and rt.exact_codes is None
    assert rt.generate([prompt], max_new_tokens=24)[0] == out["token_ids"]
    monkeypatch.setattr(cpu_ops, "library_path", lambda: built)  # the background build is done
    rt._asked = 0.0  # the disk is asked at most once a second
    got = rt.generate([prompt], max_new_tokens=24)[0]
    assert not rt.kernels_pending and not cpu_ops.deferred() and cpu_ops.enabled()
    assert rt.compile_pending and rt.plan.static_length  # compiled rounds next, at the C++ attention's length
    assert got == dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=24).token_ids
