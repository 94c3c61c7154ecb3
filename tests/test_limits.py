"""Bounded resources: checked RuntimeConfig fields, a memory check before allocation, models left
as they were by a failed Runtime, rotary tables sized by need, checkpoint sizes bounded and
non-regular files never opened."""

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import dflow_rt
from dflow_rt import CheckpointError, InputError, RuntimeConfig
from dflow_rt.engine.limits import FIELD_CHECKS, cache_bytes, row_bytes
from dflow_rt.engine.runtime import Runtime
from dflow_rt.models.bounds import parameter_count
from dflow_rt.models.checkpoint import target_config
from dflow_rt.models.layers import DEFAULT_POSITIONS
from tests.conftest import FIXTURES
from tests.helpers import fixed, ours_from_hf, random_relay, tiny_drafter, tiny_hf_target


def test_every_config_field_has_a_check():
    assert {f.name for f in dataclasses.fields(RuntimeConfig)} <= set(FIELD_CHECKS)


@pytest.mark.parametrize("field, value", [
    ("max_batch", 0), ("max_batch", 2.0), ("max_batch", True), ("max_batch", "4"), ("max_batch", 1 << 40),
    ("max_len", 1), ("max_len", 160.0), ("max_len", None), ("mode", "jit"), ("mode", 3),
    ("block_size", 0), ("block_size", 4.0), ("block_size", 10**6), ("batch_buckets", (1.0,)), ("batch_buckets", ()),
    ("batch_buckets", "12"), ("batch_buckets", (0,)), ("length_buckets", (48.5,)), ("length_buckets", (1 << 30,)),
    ("compiler", ""), ("compiler", None), ("verify_width", 1.5), ("verify_width", {1.0: 3}),
    ("verify_width", {"1": 3}), ("verify_width", [2]), ("memory_limit", -1), ("memory_limit", 1e9),
    ("kernels", 3), ("kernels", {"sample": None}),
])
def test_bad_config_fields_are_refused_by_name(reference_pair, field, value):
    target, drafter = reference_pair
    config = dataclasses.replace(fixed(max_batch=2, max_len=160), **{field: value})
    with pytest.raises(InputError, match=field):
        Runtime(target, drafter, config)


def test_memory_is_checked_before_anything_is_allocated(reference_pair, monkeypatch):
    """A resident (dense) state must fit whole; a paged one (CPU: resident as rows write) one row at
    max_len, within RESERVE_FACTOR times the memory in address space."""
    target, drafter = reference_pair
    tables = [(m.rotary.cos, m.rotary.sin) for m in (target, drafter)]
    parts = cache_bytes(target, drafter, 2, 160, drafter.block_size)
    need = sum(parts.values())
    monkeypatch.setenv("DFLOW_RT_CACHE_PAGES", "0")
    Runtime(target, drafter, fixed(max_batch=2, max_len=160, memory_limit=need))
    with pytest.raises(InputError, match="max_batch 2 x max_len 160 needs .* memory_limit"):
        Runtime(target, drafter, fixed(max_batch=2, max_len=160, memory_limit=need - 1))
    with pytest.raises(InputError, match="free memory"):  # terabytes of cache: refused, not allocated
        Runtime(target, drafter, fixed(max_batch=1 << 16, max_len=1 << 24))
    monkeypatch.setenv("DFLOW_RT_CACHE_PAGES", "1")
    rest = need - parts["target KV cache"] - parts["drafter KV cache"]
    one_row = rest + row_bytes(target, drafter, 160)
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160, memory_limit=one_row))
    assert rt.scheduler.cache_budget == one_row - rest
    with pytest.raises(InputError, match="one row of max_len 160"):
        Runtime(target, drafter, fixed(max_batch=2, max_len=160, memory_limit=one_row - 1))
    with pytest.raises(InputError, match="address space"):  # terabytes of cache: refused, not reserved
        Runtime(target, drafter, fixed(max_batch=1 << 16, max_len=1 << 20))
    assert [(m.rotary.cos, m.rotary.sin) for m in (target, drafter)] == tables


def test_paged_rows_hold_what_they_write_and_wait_for_memory(reference_pair):
    """On CPU a Runtime's caches take memory as rows write them and give it back when a request ends;
    a request whose cache would not fit beside what the others hold waits, and decodes the same tokens."""
    target, drafter = reference_pair
    case = json.loads((FIXTURES / "rounds.json").read_text())["cases"][0]
    parts = cache_bytes(target, drafter, 2, 80, drafter.block_size)
    rest = sum(parts.values()) - parts["target KV cache"] - parts["drafter KV cache"]
    one = row_bytes(target, drafter, len(case["prompt_ids"]) + 24 + drafter.block_size)
    rt = Runtime(target, drafter, fixed(max_batch=2, max_len=80, memory_limit=rest + one + one // 2))
    assert rt.scheduler.cache_budget == one + one // 2  # room for one such request, not two
    a = rt.add_request(case["prompt_ids"], max_new_tokens=24)
    b = rt.add_request(case["prompt_ids"], max_new_tokens=24)
    rt.step()
    assert rt.requests[a].row >= 0 and rt.requests[b].row == -1, "b must wait: a holds the memory"
    row = rt.requests[a].row
    while not rt.is_finished(a):
        rt.step()
    assert rt.state.target_cache.k[0][row].abs().sum() == 0, "a finished row's pages are given back (zeros)"
    while not rt.is_finished(b):
        rt.step()
    assert rt.pop(a).emitted == rt.pop(b).emitted == case["output_ids"][:24]
    assert rt.scheduler.reserved == 0


def test_a_paged_cache_is_resident_only_where_written():
    from dflow_rt.models.cache_pages import Cache

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    cache = Cache((8, 1 << 25), torch.float32, "cpu")  # 1 GiB reserved
    assert rss() - before < 64 << 20 and cache.tensor.sum() == 0
    cache.tensor[3] = 1.0  # one row: 128 MiB
    assert 120 << 20 < rss() - before < 200 << 20
    cache.release(3)
    assert rss() - before < 64 << 20 and cache.tensor[3].abs().sum() == 0


def test_a_failed_runtime_leaves_the_models_as_they_were(reference_pair, monkeypatch):
    target, drafter = reference_pair
    before = [(m.rotary.cos, m.rotary.sin) for m in (target, drafter)]
    longer = before[0][0].shape[0] + 64

    def broken(*args, **kwargs):
        raise RuntimeError("compiler failure")

    monkeypatch.setattr("dflow_rt.engine.runtime.build_rounds", broken)
    with pytest.raises(RuntimeError, match="compiler failure"):
        Runtime(target, drafter, fixed(max_batch=1, max_len=longer))
    assert [(m.rotary.cos, m.rotary.sin) for m in (target, drafter)] == before
    monkeypatch.undo()
    Runtime(target, drafter, fixed(max_batch=1, max_len=longer))  # a Runtime that succeeds grows them
    assert target.rotary.cos.shape[0] == drafter.rotary.cos.shape[0] == longer


@pytest.fixture
def target_dir(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURES / "target", tmp_path / "target"))


def edit(directory: Path, **fields) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(cfg | fields))


def test_rotary_tables_are_sized_by_need_not_by_the_config(target_dir):
    edit(target_dir, max_position_embeddings=1 << 24)
    target = dflow_rt.load_target(target_dir)
    assert target.rotary.cos.shape[0] == DEFAULT_POSITIONS
    Runtime(target, None, fixed(max_batch=1, max_len=5000))
    assert target.rotary.cos.shape[0] == 5000


@pytest.mark.parametrize("fields, needle", [
    ({"num_hidden_layers": 1000}, "describes"), ({"vocab_size": 1 << 21}, "describes"),
    ({"num_hidden_layers": 10**12}, "above the bound"), ({"head_dim": 1 << 20}, "above the bound"),
    ({"max_position_embeddings": 2**63}, "above the bound"), ({"head_dim": 15}, "even"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "high_freq_factor"),
    ({"rope_theta": float("inf"), "rope_parameters": None}, "theta"),
])
def test_config_sizes_are_bounded_before_anything_is_built(target_dir, fields, needle):
    edit(target_dir, **fields)
    with pytest.raises(CheckpointError, match=needle):
        dflow_rt.load_target(target_dir)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_non_regular_files_are_never_opened(target_dir, name):
    def hung(*_):
        raise TimeoutError("the loader blocked on a FIFO")

    os.remove(target_dir / name)
    os.mkfifo(target_dir / name)
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(CheckpointError, match="not a regular file"):
            dflow_rt.load_target(target_dir)
        if name == "model.safetensors":
            os.remove(target_dir / name)
            os.symlink("/dev/zero", target_dir / name)  # a device: reading would never end
            with pytest.raises(CheckpointError, match="not a regular file"):
                dflow_rt.load_target(target_dir)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("family, tied", [("qwen3", False), ("qwen3", True), ("llama", False)])
def test_parameter_count_is_exact(family, tied):
    target = ours_from_hf(tiny_hf_target(0, family=family, tied=tied))
    stored = {k: v for k, v in target.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert parameter_count(target.config) == sum(v.numel() for v in stored.values())
    for drafter in (tiny_drafter(target, 0), random_relay(tiny_drafter(target, 0), relay_hidden=16)):
        assert parameter_count(drafter.config) == sum(p.numel() for p in drafter.state_dict().values())


def test_parameter_count_covers_biases(target_dir):
    edit(target_dir, attention_bias=True, mlp_bias=True)
    with torch.device("meta"):
        model = dflow_rt.Target(target_config(json.loads((target_dir / "config.json").read_text()), "c"))
    assert parameter_count(model.config) == sum(p.numel() for p in model.state_dict().values())
