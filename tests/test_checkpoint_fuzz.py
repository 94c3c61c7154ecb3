"""Mutated checkpoints load correctly or raise CheckpointError, never anything else, and never
take more than a bounded time and memory: a config.json or a safetensors header is untrusted
input, and a size in it must not be able to hang the loader or exhaust the machine.

Each case runs in-process under a deadline (SIGALRM interrupts a runaway loop) and a bound on
the growth of the process's peak resident memory.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import dflow_rt
import dflow_rt.oracle
from dflow_rt import CheckpointError
from dflow_rt.models.layers import reserve_positions
from tests.conftest import FIXTURES

SECONDS, PEAK_GROWTH_MIB = 10, 256
TARGET, DRAFTER = FIXTURES / "target", FIXTURES / "drafter"
TARGET_CFG = json.loads((TARGET / "config.json").read_text())
DRAFTER_CFG = json.loads((DRAFTER / "config.json").read_text())
RAW = (TARGET / "model.safetensors").read_bytes()
HEADER_LEN = int.from_bytes(RAW[:8], "little")
HEADER = json.loads(RAW[8:8 + HEADER_LEN])
NAMES = sorted(k for k in HEADER if k != "__metadata__")

SIZES = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "vocab_size", "max_position_embeddings", "block_size", "num_target_layers", "relay_hidden"}
EXTREMES = [0, -1, 1, 3, 7, 2**16 + 1, 2**24 + 1, 2**31, 2**63, 10**30, 1e308, 0.5, float("nan"), float("inf")]
VALUES = st.one_of(st.none(), st.booleans(), st.sampled_from(EXTREMES), st.integers(-4, 70),
                   st.text(max_size=4), st.lists(st.integers(-2, 30), max_size=3),
                   st.dictionaries(st.sampled_from(["rope_type", "factor", "rope_theta", "x"]),
                                   st.one_of(st.sampled_from(["llama3", "default", "yarn"]), st.sampled_from(EXTREMES)),
                                   max_size=3))
LLAMA3 = st.fixed_dictionaries({"rope_type": st.just("llama3"), "factor": st.sampled_from(EXTREMES),
                                "low_freq_factor": st.sampled_from(EXTREMES),
                                "high_freq_factor": st.sampled_from(EXTREMES),
                                "original_max_position_embeddings": st.sampled_from(EXTREMES)})


def config_edits(cfg: dict, nested: tuple[str, ...] = ()) -> st.SearchStrategy:
    """Up to three edits of `cfg`: drop a key, or set a key (existing or one the loader reads) to an
    odd value; `nested` names sub-objects whose own keys may be edited too (as "outer.inner")."""
    keys = sorted(cfg) + ["rope_scaling", "rope_theta", "head_dim", "tie_word_embeddings", "mlp_bias"]
    keys += [f"{n}.{k}" for n in nested for k in (*cfg.get(n, {}), "block_size", "relay_hidden", "relay_input")]
    sizes = [k for k in keys if k.split(".")[-1] in SIZES]  # half the edits hit a size field
    edit = st.tuples(st.sampled_from(["drop", "set", "set"]), st.one_of(st.sampled_from(sizes), st.sampled_from(keys)),
                     st.one_of(st.sampled_from(EXTREMES), VALUES, LLAMA3))
    return st.lists(edit, max_size=3)


def apply_edits(cfg: dict, edits) -> dict:
    cfg = json.loads(json.dumps(cfg))
    for op, key, value in edits:
        *outer, name = key.split(".")
        where = cfg.setdefault(outer[0], {}) if outer else cfg
        if not isinstance(where, dict):
            continue
        if op == "drop":
            where.pop(name, None)
        else:
            where[name] = value
    return cfg


@contextlib.contextmanager
def bounded(seconds: int = SECONDS, peak_mib: int = PEAK_GROWTH_MIB) -> Iterator[None]:
    """Fail a case that runs past `seconds` (interrupting it) or raises peak RSS by `peak_mib`."""
    def expire(*_):
        raise TimeoutError(f"a case ran past {seconds} s")

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown < peak_mib, f"peak resident memory grew by {grown:.0f} MiB"


def loads_or_refuses(load: Callable[[], torch.nn.Module], run: Callable[[torch.nn.Module], None]) -> str:
    """'loaded' (and the model runs) or 'refused' (CheckpointError); any other exception fails."""
    with bounded():
        try:
            model = load()
        except CheckpointError as err:
            assert "\n" not in str(err)
            return "refused"
        run(model)
    return "loaded"


def run_target(model: dflow_rt.Target) -> None:
    reserve_positions(4, model)
    logits, _ = model(torch.tensor([[0, 1, 2]]), torch.arange(3)[None])
    assert logits.shape == (1, 3, model.config.vocab_size)


def write_dir(root: Path, cfg: dict | str, weights: bytes | Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    if isinstance(weights, Path):
        (root / "model.safetensors").symlink_to(weights)
    else:
        (root / "model.safetensors").write_bytes(weights)
    return root


@pytest.fixture(scope="module")
def target() -> dflow_rt.Target:
    return dflow_rt.load_target(TARGET)


@settings(max_examples=150)
@given(edits=config_edits(TARGET_CFG, nested=("rope_parameters",)))
def test_mutated_target_config(edits):
    cfg = apply_edits(TARGET_CFG, edits)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_dir(Path(tmp) / "t", cfg, TARGET / "model.safetensors")
        event(loads_or_refuses(lambda: dflow_rt.load_target(directory), run_target))


@settings(max_examples=100)
@given(edits=config_edits(DRAFTER_CFG, nested=("dflash_config", "dflow_config")))
def test_mutated_drafter_config(target, edits):
    cfg = apply_edits(DRAFTER_CFG, edits)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_dir(Path(tmp) / "d", cfg, DRAFTER / "model.safetensors")
        event(loads_or_refuses(lambda: dflow_rt.load_drafter(directory, target),
                               lambda d: dflow_rt.oracle.generate(target, d, [1, 2, 3], max_new_tokens=4)))


DTYPES = ["F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "Q4", "", 5, None]
SHAPES = st.one_of(st.lists(st.sampled_from([0, 1, 2, 16, 24, 64, 2**31, 2**62, -1]), max_size=4),
                   st.sampled_from([None, "64", 7, {"a": 1}]))
OFFSETS = st.one_of(st.lists(st.integers(-1, len(RAW) + 10), min_size=2, max_size=2),
                    st.lists(st.sampled_from([0, 2**40, 2**63, 2**64 + 3]), min_size=0, max_size=3),
                    st.sampled_from([None, "0", [0.5, 4]]))
HEADER_EDITS = st.one_of(
    st.tuples(st.just("dtype"), st.sampled_from(NAMES), st.sampled_from(DTYPES)),
    st.tuples(st.just("shape"), st.sampled_from(NAMES), SHAPES),
    st.tuples(st.just("data_offsets"), st.sampled_from(NAMES), OFFSETS),
    st.tuples(st.just("drop"), st.sampled_from(NAMES), st.none()),
    st.tuples(st.just("__metadata__"), st.none(), st.sampled_from([None, 3, {"format": 1}, {"a": "b"}, "pt"])),
)
LENGTHS = st.one_of(st.none(), st.integers(-8, 8), st.sampled_from([2**63, 2**64 - 1, 100 << 20, 2**32]))


@settings(max_examples=150)
@given(edits=st.lists(HEADER_EDITS, min_size=1, max_size=3), length=LENGTHS)
def test_mutated_safetensors_header(edits, length):
    """Header edits, written back with the header's new length (or a wrong one, `length`), then
    the original data: every case loads (an edit the data still agrees with) or is refused."""
    header = json.loads(json.dumps(HEADER))
    for field, name, value in edits:
        if field == "__metadata__":
            header["__metadata__"] = value
        elif field == "drop":
            header.pop(name, None)
        elif name in header:
            header[name][field] = value
    text = json.dumps(header).encode()
    size = len(text) if length is None else (len(text) + length if abs(length) < 16 else length)
    raw = (size % 2**64).to_bytes(8, "little") + text + RAW[8 + HEADER_LEN:]
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_dir(Path(tmp) / "t", TARGET_CFG, raw)
        event(loads_or_refuses(lambda: dflow_rt.load_target(directory), run_target))


def test_the_bounds_do_fail_a_runaway_case():
    """The harness itself: a case past its deadline or its memory bound fails."""
    with pytest.raises(TimeoutError), bounded(seconds=1):
        while True:
            pass
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    now_kib = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() // 1024
    extra = (peak_kib - now_kib) * 1024 + (128 << 20)  # past the peak earlier tests left, by 128 MiB
    if extra > 2 << 30:
        pytest.skip("earlier tests left a peak too far above the current footprint")
    with pytest.raises(AssertionError, match="peak resident"), bounded(peak_mib=64):
        torch.ones(extra // 4).sum()
