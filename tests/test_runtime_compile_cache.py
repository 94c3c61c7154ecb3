"""Compiled rounds kept on disk: the same tokens with and without the cache, a later Runtime of the
same shapes starts from the entry, a corrupted entry is detected and rebuilt, the bound holds."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from torch._dynamo.aot_compile import AOTCompiledFunction
from torch.torch_version import TorchVersion

import dflow_rt
import dflow_rt.oracle
from dflow_rt import Runtime, RuntimeConfig, compat
from dflow_rt.engine.settings import resolve_config as resolve
from dflow_rt.errors import InputError
from dflow_rt.graphs import compile_cache, runner
from dflow_rt.graphs.plan import RoundPlan
from dflow_rt.kernels.attention import cpu_serves_every_pass
from dflow_rt.kernels.cpu import ops as cpu_ops
from tests.test_runtime import CASES


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLOW_RT_CACHE", str(tmp_path))
    return tmp_path / "compiled"


def config(**kw) -> RuntimeConfig:
    """Greedy rounds only, each compile costing CI tens of seconds: two graphs (the fallback's widths 1
    and 2), or with `one=True` a single one."""
    one = {"ar_fallback": False} if kw.pop("one", False) else {}
    return RuntimeConfig(**{"max_batch": 1, "max_len": 128, "length_buckets": (64,), "mode": "compile",
                            "verify_width": 2, "ar_fallback": True, "lookup": False, "sampling": False,
                            **one, **kw})


def test_cached_rounds_decode_the_same_tokens_and_a_corrupt_entry_is_rebuilt(reference_pair, cache, capsys):
    target, drafter = reference_pair
    prompts = [c["prompt_ids"] for c in CASES[:2]]
    cold = Runtime(target, drafter, config(eager_start=True))  # an empty cache: eager rounds at once
    assert cold.compile_pending
    want = [cold.generate([p], max_new_tokens=40)[0] for p in prompts]
    assert want == [dflow_rt.oracle.generate(target, drafter, p, max_new_tokens=40).token_ids for p in prompts]
    fresh = Runtime(target, drafter, config(compile_cache=False, one=True))
    assert [fresh.generate([p], max_new_tokens=40)[0] for p in prompts] == want
    assert not cache.exists()  # neither an eager start nor compile_cache=False writes anything

    grads = [torch.full_like(p, 0.5) for p in target.parameters()]  # as a model trained in this process has
    for p, g in zip(target.parameters(), grads, strict=True):
        p.grad = g
    try:
        first = Runtime(target, drafter, config())
        assert all(p.grad is g for p, g in zip(target.parameters(), grads, strict=True))  # left as they were
    finally:
        for p in target.parameters():
            p.grad = None
    (entry,) = compile_cache.entries()
    graphs = sorted((cache / entry["key"]).glob("*" + compile_cache.GRAPH))
    assert not first.compile_cache_hit and len(graphs) == entry["graphs"] == len(first.plan.round_widths(1))
    second = Runtime(target, drafter, config())
    assert second.compile_cache_hit
    for rt in (first, second):
        assert [rt.generate([p], max_new_tokens=40)[0] for p in prompts] == want
    cold._asked = 0.0  # the disk is asked at most once a second
    assert cold.generate([prompts[0]], max_new_tokens=40)[0] == want[0]
    assert not cold.compile_pending and cold.compile_cache_hit  # switched between requests, from the disk

    graph = graphs[0]
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    graph.write_bytes(bytes(data))
    rebuilt = Runtime(target, drafter, config())
    assert not rebuilt.compile_cache_hit and "does not match its checksum: rebuilding it" in capsys.readouterr().err
    meta = json.loads((cache / entry["key"] / compile_cache.META).read_text())
    assert compile_cache.hashlib.sha256(graph.read_bytes()).hexdigest() == meta["graphs"][graph.stem]["sha256"]
    assert [rebuilt.generate([p], max_new_tokens=40)[0] for p in prompts] == want  # written again, whole

    graph.write_bytes(b"not a graph")  # a checksum that matches bytes torch cannot read
    meta["graphs"][graph.stem]["sha256"] = compile_cache.hashlib.sha256(b"not a graph").hexdigest()
    (cache / entry["key"] / compile_cache.META).write_text(json.dumps(meta))
    refused = Runtime(target, drafter, config())
    assert "was refused by torch" in capsys.readouterr().err and not refused.compile_cache_hit
    assert [refused.generate([p], max_new_tokens=40)[0] for p in prompts] == want

    (cache / entry["key"] / compile_cache.META).write_text("{not json")
    external = {"target": target, "drafter": drafter}
    assert compile_cache.Entry(entry["key"], {}).load(graph.stem, external) is None
    assert not (cache / entry["key"]).exists()


def test_a_graph_whose_guards_reject_the_runtime_is_rebuilt(reference_pair, cache, capsys, monkeypatch):
    """A file that passes its checksum but was compiled for other shapes (here: another block size,
    copied in under this entry's names) is never run: its guards reject the state, and it is rebuilt.
    Guards then run when a request is admitted, not on every step, and still refuse a changed model."""
    target, drafter = reference_pair
    prompt = CASES[0]["prompt_ids"]
    Runtime(target, drafter, config(one=True))
    (other,) = compile_cache.entries()
    small = config(block_size=8, one=True)
    plan = RoundPlan.of(resolve(small, target, drafter), target, drafter)
    key = compile_cache.entry_key(target, drafter, plan.graph_settings())[0]
    assert key != other["key"]
    shutil.copytree(cache / other["key"], cache / key)  # the same names, valid checksums, wrong shapes
    capsys.readouterr()
    rt = Runtime(target, drafter, small)
    err = capsys.readouterr().err
    assert not rt.compile_cache_hit and err.count("does not fit this Runtime") == 1, err
    want = dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=30).token_ids  # greedy: the target's own
    checks = []
    check = AOTCompiledFunction.guard_check
    monkeypatch.setattr(AOTCompiledFunction, "guard_check", lambda *a, **k: checks.append(1) or check(*a, **k))
    assert rt.generate([prompt], max_new_tokens=30)[0] == want
    assert len(checks) == 1  # at admission; the request's rounds (at least 8 here) check none
    loaded = Runtime(target, drafter, small)
    assert loaded.compile_cache_hit
    weight = target.model.norm.weight
    kept, grad = weight.data, weight.requires_grad
    try:
        weight.requires_grad_(not weight.requires_grad)  # guarded, and no step between admissions sees it
        loaded.add_request(prompt, max_new_tokens=5)
        with pytest.raises(InputError, match="changed after this Runtime was built"):
            loaded.step()
        weight.requires_grad_(not weight.requires_grad)
        loaded.step()  # admitted now
        weight.data = kept.double()  # mid-request: the rounds would read the old weight's memory
        with pytest.raises(InputError, match="was replaced after this Runtime was built"):
            loaded.step()
    finally:  # the models are shared with other tests
        weight.data = kept
        weight.requires_grad_(grad)


def test_the_key_follows_what_the_compiled_code_depends_on(reference_pair, monkeypatch):
    target, drafter = reference_pair
    base = {"block_size": 8, "layer_ids": (1, 2)}
    key, what = compile_cache.entry_key(target, drafter, base)
    assert key == compile_cache.entry_key(target, drafter, dict(base))[0]
    assert what["torch"] == torch.__version__ and what["code"] and what["drafter"]["config"]["block_size"]
    assert key != compile_cache.entry_key(target, drafter, {**base, "layer_ids": (0, 2)})[0]
    assert key != compile_cache.entry_key(target, None, base)[0]
    half = dflow_rt.Target(target.config).to(torch.bfloat16)
    assert key != compile_cache.entry_key(half, drafter, base)[0]
    kernel = cpu_ops.enabled()
    monkeypatch.setattr(cpu_ops, "_ready", not kernel)  # DFLOW_RT_CPU_GEMV=0, or a CPU without the kernel
    assert key != compile_cache.entry_key(target, drafter, base)[0]


def test_the_cache_keeps_its_bound_and_clears(cache):
    for i, size in enumerate((300, 300, 300)):
        entry = cache / f"k{i}"
        entry.mkdir(parents=True)
        (entry / ("g" + compile_cache.GRAPH)).write_bytes(b"x" * size)
        (entry / compile_cache.META).write_text(json.dumps({"graphs": {"g": {"bytes": size, "sha256": ""}}}))
        compile_cache.os.utime(entry / compile_cache.META, (i, i))  # k0 used longest ago
    old = cache / "k3"  # an entry of an older format (one blob, no graphs), recently used: no Runtime reads it
    old.mkdir()
    (old / compile_cache.META).write_text(json.dumps({"bytes": 10, "sha256": ""}))
    for name, age in (("k4", 7200), ("k5", 0)):  # graphs without entry.json: a stopped process's, or a running one's
        torn = cache / name
        torn.mkdir()
        (torn / ("g" + compile_cache.GRAPH)).write_bytes(b"x" * 50)
        compile_cache.os.utime(torn, (compile_cache.time.time() - age,) * 2)
    compile_cache.prune(750)
    assert [e["key"] for e in compile_cache.entries()] == ["k5", "k2", "k1"]
    assert compile_cache.clear() >= 600 and compile_cache.entries() == [] and not cache.exists()


def test_a_cpu_plan_without_length_buckets_traces_one_static_length(reference_pair, cache):
    """On CPU the C++ attention reads each row's keys up to its own position, so a compiled plan
    without length buckets runs one length traced as a constant: max_len rounded up to a power of two
    (at least 512), which the compile cache's key holds. Its rounds decode the reference's tokens."""
    target, drafter = reference_pair
    if not cpu_serves_every_pass(target, drafter, drafter.block_size):
        pytest.skip("the C++ attention does not serve these models here")
    settings = {"max_batch": 1, "mode": "compile", "verify_width": 4, "sampling": False, "ar_fallback": False}

    def plan(**kw):
        return RoundPlan.of(resolve(RuntimeConfig(**settings, **kw), target, drafter), target, drafter)

    assert [plan(max_len=n).lengths for n in (160, 512, 600)] == [(512,), (512,), (1024,)]
    assert not plan(max_len=160, length_buckets=(64,)).static_length  # buckets given: the length a symbol
    keys = {n: compile_cache.entry_key(target, drafter, plan(max_len=n).graph_settings())[0] for n in (160, 300, 600)}
    assert keys[160] == keys[300] != keys[600]
    rt = Runtime(target, drafter, RuntimeConfig(**settings, max_len=160))
    assert rt.plan.static_length and {key[1] for key in rt.rounds} == {512}
    for case in CASES[:2]:
        want = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=40).token_ids
        assert rt.generate([case["prompt_ids"]], max_new_tokens=40)[0] == want


@pytest.mark.skipif(compat.cpp_compiler() is None, reason="inductor compiles CPU rounds with a C++ compiler")
def test_an_unknown_torch_compiles_plain_rounds_that_decode_the_oracles_tokens(reference_pair, tmp_path,
                                                                               monkeypatch, caplog):
    """Plain `torch.compile` with its guards: nothing compiled ahead of time, nothing kept on disk,
    one warning; the tokens are the oracle's."""
    target, drafter = reference_pair
    cpu_ops.enabled()  # the kernel library as this torch built it, not built again for another version
    monkeypatch.setenv("DFLOW_RT_CACHE", str(tmp_path))
    monkeypatch.setattr(compat, "_said", set())
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.99.0"))
    small = config(sampling=False, ar_fallback=False)
    prompt = CASES[0]["prompt_ids"]
    with caplog.at_level(logging.WARNING, logger="dflow_rt"):
        rt = Runtime(target, drafter, small)
        got = rt.generate([prompt], max_new_tokens=12)[0]
    said = [r.getMessage() for r in caplog.records if "is not a version dflow-rt is tested with" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert not any(map(runner._ahead_of_time, rt.rounds.values()))  # every round guards its own calls
    assert not rt.compile_cache_hit and compile_cache.entries() == []
    assert got == dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=12).token_ids
