"""torch's private interfaces go through `dflow_rt.compat` alone, which knows the torch versions it was
tested with; without a C++ compiler, rounds run eager and the process says so in one line. (A
compiled Runtime on a torch `compat` does not know: tests/test_runtime_compile_cache.py, which runs
after the Triton interpreter's tests.)"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import torch
from torch.torch_version import TorchVersion

import dflow_rt.oracle
from dflow_rt import Runtime, RuntimeConfig, compat
from dflow_rt.kernels.cpu import ops as cpu_ops
from tests.test_runtime import CASES

PACKAGE = Path(dflow_rt.__file__).resolve().parent


def _private_uses(tree: ast.AST) -> list[str]:
    """Private names reached from `torch` (`torch._dynamo`, `torch.compiler._x`) and imports of
    `torch._x` modules in `tree`; ops by name (`torch.ops.<namespace>.<op>`, the dispatcher's public
    table) are not torch's modules."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and node.attr != "__version__":
            chain, root = [], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id == "torch" and (not chain or chain[-1] != "ops"):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch._")]
    return found


def test_private_torch_is_used_in_compat_alone():
    assert _private_uses(ast.parse("import torch._dynamo\nfrom torch._inductor import config\ntorch._dynamo.x = 1"))
    assert not _private_uses(ast.parse("torch.__version__, weight._version, torch.compile(f), torch.ops.x._y()"))
    found = {str(p.relative_to(PACKAGE)): uses for p in sorted(PACKAGE.rglob("*.py"))
             if p.name != "compat.py" and (uses := _private_uses(ast.parse(p.read_text())))}
    assert not found, f"private torch outside dflow_rt/compat.py: {found}"
    assert _private_uses(ast.parse((PACKAGE / "compat.py").read_text()))  # the check sees them where they are


def test_the_version_switch(monkeypatch, caplog):
    monkeypatch.setattr(compat, "_said", set())
    assert compat.version() in compat.SUPPORTED and compat.known()  # the torch these tests run on
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.99.1+cpu"))
    assert compat.version() == "2.99"
    with caplog.at_level(logging.WARNING, logger="dflow_rt"):
        assert not compat.known() and not compat.known()
    assert len(caplog.records) == 1 and "torch 2.99.1+cpu is not a version" in caplog.records[0].getMessage()


def test_without_a_compiler_rounds_run_eager_and_say_so_once(reference_pair, tmp_path, monkeypatch, caplog):
    target, drafter = reference_pair
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler there
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("DFLOW_RT_CACHE", str(tmp_path))  # no kernel library built before
    monkeypatch.setattr(compat, "_said", set())
    monkeypatch.setattr(cpu_ops, "_ready", None)
    assert compat.cpp_compiler() is None
    prompt = CASES[0]["prompt_ids"]
    with caplog.at_level(logging.WARNING, logger="dflow_rt"):
        rt = Runtime(target, drafter, RuntimeConfig(max_batch=1, max_len=96, mode="compile", verify_width=4))
        got = rt.generate([prompt], max_new_tokens=12)[0]
        Runtime(target, drafter, RuntimeConfig(max_batch=1, max_len=96, mode="compile", verify_width=4))
    assert [r.getMessage() for r in caplog.records] == [
        "no C++ compiler: g++ is not on PATH (or set CXX to one), so CPU rounds run eager, without the C++ kernels"]
    assert not cpu_ops.enabled() and not list(tmp_path.glob("compiled/*"))
    assert got == dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=12).token_ids
