"""Compiled rounds kept on disk: the same tokens with and without the cache, a later Runtime of the
same shapes starts from the entry, a corrupted entry is detected and rebuilt, the bound holds.

(Named to run after test_kernels.py, as test_runtime.py does: a real inductor compile earlier in the
process breaks the Triton interpreter those tests run the kernels in.)"""

from __future__ import annotations

import json

import pytest
import torch

import dflow_rt
from dflow_rt import Runtime, RuntimeConfig
from dflow_rt.graphs import compile_cache
from dflow_rt.models import cpu_gemv
from tests.test_runtime import CASES


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLOW_RT_CACHE", str(tmp_path))
    return tmp_path / "compiled"


def config(**kw) -> RuntimeConfig:
    return RuntimeConfig(max_batch=1, max_len=128, length_buckets=(64,), mode="compile", verify_width=4, **kw)


def test_cached_rounds_decode_the_same_tokens_and_a_corrupt_entry_is_rebuilt(reference_pair, cache, capsys):
    target, drafter = reference_pair
    prompts = [c["prompt_ids"] for c in CASES[:2]]
    fresh = Runtime(target, drafter, config(compile_cache=False))
    want = [fresh.generate([p], max_new_tokens=40)[0] for p in prompts]
    assert want == [dflow_rt.reference.generate(target, drafter, p, max_new_tokens=40).token_ids for p in prompts]
    assert not cache.exists()  # compile_cache=False writes nothing

    first = Runtime(target, drafter, config())
    (entry,) = compile_cache.entries()
    blob = cache / entry["key"] / compile_cache.BLOB
    assert not first.compile_cache_hit and blob.stat().st_size == entry["bytes"] > 0
    second = Runtime(target, drafter, config())
    assert second.compile_cache_hit
    for rt in (first, second):
        assert [rt.generate([p], max_new_tokens=40)[0] for p in prompts] == want

    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    blob.write_bytes(bytes(data))
    rebuilt = Runtime(target, drafter, config())
    assert not rebuilt.compile_cache_hit and "does not match its checksum: rebuilding it" in capsys.readouterr().err
    meta = json.loads((cache / entry["key"] / compile_cache.META).read_text())
    assert compile_cache.hashlib.sha256(blob.read_bytes()).hexdigest() == meta["sha256"]  # written again, whole
    assert [rebuilt.generate([p], max_new_tokens=40)[0] for p in prompts] == want
    (cache / entry["key"] / compile_cache.META).write_text("{not json")
    assert not compile_cache.load(entry["key"]) and not (cache / entry["key"]).exists()


def test_the_key_follows_what_the_compiled_code_depends_on(reference_pair, monkeypatch):
    target, drafter = reference_pair
    base = {"rows": (1,), "widths": {1: 4}}
    key, what = compile_cache.entry_key(target, drafter, base)
    assert key == compile_cache.entry_key(target, drafter, dict(base))[0]
    assert what["torch"] == torch.__version__ and what["code"] and what["drafter"]["config"]["block_size"]
    assert key != compile_cache.entry_key(target, drafter, {**base, "widths": {1: 8}})[0]
    assert key != compile_cache.entry_key(target, None, base)[0]
    half = dflow_rt.Target(target.config).to(torch.bfloat16)
    assert key != compile_cache.entry_key(half, drafter, base)[0]
    kernel = cpu_gemv.enabled()
    monkeypatch.setattr(cpu_gemv, "_ready", not kernel)  # DFLOW_RT_CPU_GEMV=0, or a CPU without the kernel
    assert key != compile_cache.entry_key(target, drafter, base)[0]


def test_the_cache_keeps_its_bound_and_clears(cache):
    for i, size in enumerate((300, 300, 300)):
        entry = cache / f"k{i}"
        entry.mkdir(parents=True)
        (entry / compile_cache.BLOB).write_bytes(b"x" * size)
        (entry / compile_cache.META).write_text(json.dumps({"bytes": size, "sha256": ""}))
        compile_cache.os.utime(entry / compile_cache.META, (i, i))  # k0 used longest ago
    compile_cache.prune(700)
    assert [e["key"] for e in compile_cache.entries()] == ["k2", "k1"]
    assert compile_cache.clear() >= 600 and compile_cache.entries() == [] and not cache.exists()
