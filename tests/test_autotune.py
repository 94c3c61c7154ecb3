"""Autotune: the loader reads what the job writes, falls back loudly, and the job keeps only faster
lossless knobs (the tiny fixture models, with a timer that says which candidate is fast)."""

import copy
import json
import logging
import random

import pytest

from dflow_rt.autotune.job import Axis, Measure, Tuner
from dflow_rt.config import RuntimeConfig
from dflow_rt.engine import tuned as configs
from dflow_rt.engine.settings import apply_tuned as apply
from dflow_rt.engine.settings import resolve_config as resolve
from dflow_rt.engine.tuned import TunedConfig, entry_key, load_tuned, store
from tests.conftest import FIXTURES

TARGET, DRAFTER = FIXTURES / "target", FIXTURES / "drafter"
DEFAULT = TunedConfig("float32", 1)
PROMPTS = [[random.Random(i).randrange(23) for _ in range(6 + i)] for i in range(2)]


def fixed_speed(speeds: dict, knob=lambda point, rows: point.length_step):
    """A timer that reports tokens/s by knob value (default: length_step), whatever the wall clock says."""
    def timer(point, rows, run):
        tokens = run()
        return tokens, tokens / speeds.get(knob(point, rows), 100.0)
    return timer


def tuner(reference_pair, speeds: dict, axes, cls=Tuner, **kw) -> Tuner:
    measure = Measure(max_new=24, repeats=3, max_len=128)
    return cls(lambda dtype: reference_pair, PROMPTS, [1, 2], DEFAULT, axes, measure, timer=fixed_speed(speeds, **kw),
               progress=False)


class WithLossyCandidate(Tuner):
    """length_step 32 stands for a candidate that changes the tokens."""

    def decode(self, point, group, ar=False):
        tokens, tps = super().decode(point, group, ar)
        return ([[(t + 1) % 23 for t in row] for row in tokens] if point.length_step == 32 else tokens), tps


def test_picks_the_faster_candidate_and_never_a_lossy_one(reference_pair):
    axes = [Axis("length_step", (32, 128, 256))]
    result = tuner(reference_pair, {None: 100.0, 32: 400.0, 128: 200.0, 256: 150.0}, axes, WithLossyCandidate).search()
    status = {t["knobs"]["length_step"]: t["status"] for t in result.trials}
    assert status[32].startswith("lossy") and status[128] == status[256] == "measured"
    assert result.tuned.length_step == 128 and not result.kept_default
    assert all(p.ratio == pytest.approx(2.0) for p in result.final.values())


def test_keeps_the_default_when_nothing_beats_its_noise(reference_pair):
    result = tuner(reference_pair, {None: 100.0, 128: 101.0}, [Axis("length_step", (128,))]).search()
    assert result.kept_default and result.tuned == DEFAULT


def test_verify_width_is_chosen_per_batch_bucket(reference_pair):
    speeds = {(1, 4): 300.0, (1, 8): 200.0, (2, 8): 300.0, (2, 4): 200.0}  # the default width 16: 100
    axes = [Axis("verify_width", (8, 4), per_bucket=True)]
    result = tuner(reference_pair, speeds, axes, knob=lambda point, rows: (rows, dict(point.verify_width).get(rows))
                   ).search()
    assert dict(result.tuned.verify_width) == {1: 4, 2: 8} and not result.kept_default


def test_loader_round_trips_what_the_job_writes(reference_pair, tmp_path, caplog):
    result = tuner(reference_pair, {None: 100.0, 128: 300.0}, [Axis("length_step", (128,))]).search()
    name = configs.device_name("cpu")
    entry = {"dtype": result.tuned.dtype, "knobs": {result.tuned.dtype: result.record(16)}}
    path = store(entry, entry_key(TARGET, DRAFTER), name, tmp_path)
    with caplog.at_level(logging.INFO, logger="dflow_rt.engine.tuned"):
        loaded = load_tuned(TARGET, DRAFTER, "cpu", directory=tmp_path)
    assert loaded == TunedConfig("float32", 1, "eager", ((1, 16), (2, 16)), 128) and loaded.path == path
    assert str(path) in caplog.text
    config = apply(RuntimeConfig(max_batch=4, max_len=512), loaded)
    assert config.verify_width == {1: 16, 2: 16, 4: 16} and config.length_buckets == (128, 256, 384)
    bucket = json.loads(path.read_text())["entries"][entry_key(TARGET, DRAFTER)]["knobs"]["float32"]["buckets"]["1"]
    assert bucket["tuned_tokens_per_s"] == pytest.approx(3 * bucket["default_tokens_per_s"], rel=1e-3)


def test_missing_or_corrupt_file_falls_back_with_a_log_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dflow_rt.engine.tuned"):
        assert load_tuned(TARGET, DRAFTER, "cpu", directory=tmp_path) is None
        assert "no tuned file" in caplog.text
        (tmp_path / f"{configs.device_key(configs.device_name('cpu'))}.json").write_text("{not json")
        assert load_tuned(TARGET, DRAFTER, "cpu", directory=tmp_path) is None
        assert "unreadable" in caplog.text
        caplog.clear()
        knobs = {"mode": "eager", "threads": 1, "length_step": 0, "buckets": {}}  # would make range() fail
        store({"dtype": "float32", "knobs": {"float32": knobs}}, entry_key(TARGET, DRAFTER),
              configs.device_name("cpu"), tmp_path)
        assert load_tuned(TARGET, DRAFTER, "cpu", directory=tmp_path) is None
        assert "unreadable" in caplog.text
    assert apply(RuntimeConfig(), None) == RuntimeConfig()


def test_keys_differ_by_device_name(tmp_path, monkeypatch, reference_pair):
    a, b = "AMD EPYC (2 cores)", "Intel(R) Xeon(R) Platinum 8480+ (2 cores)"
    assert configs.device_key(a) != configs.device_key(b)
    for name, mode in ((a, "compile"), (b, "eager")):
        key = "mode" if name == a else "backend"  # files written before the knob's rename call it "backend"
        knobs = {key: mode, "threads": 1, "length_step": None, "buckets": {"1": {"verify_width": 4}}}
        store({"dtype": "float32", "knobs": {"float32": knobs}}, entry_key(TARGET, DRAFTER), name, tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2
    monkeypatch.setenv("DFLOW_RT_CONFIG", str(tmp_path.parent))
    monkeypatch.setattr(configs, "tuned_dir", lambda directory=None: tmp_path)
    for name, mode in ((a, "compile"), (b, "eager")):
        monkeypatch.setattr(configs, "device_name", lambda device="cpu", name=name: name)
        assert load_tuned(TARGET, DRAFTER).mode == mode
        # the Runtime's hook: the loaded models' directories, device and dtype pick the entry
        config = resolve(RuntimeConfig(max_batch=2, max_len=128), *reference_pair)
        assert config.mode == mode and config.verify_width == {1: 4, 2: 4}
    monkeypatch.setattr(configs, "device_name", lambda device="cpu": "NVIDIA H200")
    assert load_tuned(TARGET, DRAFTER) is None


def test_auto_fields_take_the_tuned_knobs_else_the_device_defaults(tmp_path, monkeypatch, reference_pair):
    """RuntimeConfig() chooses per device: an autotune entry for these models when one exists (explicit
    settings still win, tuned=False ignores it), else DEVICE_DEFAULTS for the device and dtype."""
    import torch

    from dflow_rt.config import AUTO, DEVICE_DEFAULTS

    target, drafter = reference_pair
    monkeypatch.setattr(configs, "tuned_dir", lambda directory=None: tmp_path)
    plain = RuntimeConfig()
    assert (plain.mode, plain.verify_width, plain.tuned) == (AUTO, AUTO, True)
    cpu = DEVICE_DEFAULTS["cpu", "float32"]
    resolved = resolve(plain, target, drafter)
    assert (resolved.mode, resolved.verify_width, resolved.ar_fallback) == (cpu["mode"], cpu["verify_width"], True)
    assert resolve(RuntimeConfig(verify_width=4), target, drafter).ar_fallback is False  # a width given is kept
    assert resolve(plain, target, None).ar_fallback is False  # nothing to fall back from
    knobs = {"mode": "eager", "threads": 1, "length_step": None, "buckets": {"1": {"verify_width": 5}}}
    store({"dtype": "float32", "knobs": {"float32": knobs}}, entry_key(TARGET, DRAFTER), configs.device_name("cpu"),
          tmp_path)
    tuned = resolve(RuntimeConfig(max_batch=2), target, drafter)
    assert (tuned.mode, tuned.verify_width, tuned.ar_fallback) == ("eager", {1: 5, 2: 5}, True)
    mine = resolve(RuntimeConfig(max_batch=2, mode="compile"), target, drafter)
    assert (mine.mode, mine.verify_width) == ("compile", {1: 5, 2: 5})
    off = resolve(RuntimeConfig(tuned=False), target, drafter)
    assert (off.mode, off.verify_width) == (cpu["mode"], cpu["verify_width"])
    half = resolve(RuntimeConfig(), copy.deepcopy(target).to(torch.bfloat16), drafter)  # no bf16 entry: bf16 defaults
    assert (half.mode, half.verify_width, half.ar_fallback) == tuple(DEVICE_DEFAULTS["cpu", "bfloat16"].values())


def test_axes_vary_one_knob_or_a_joint_pair():
    start = TunedConfig("bfloat16", 1)
    joint = Axis("mode+dtype", (("compile", "float32"), ("compile", "bfloat16"), ("eager", "bfloat16")))
    assert [(c.mode, c.dtype) for c in joint.candidates(start, [1, 4])] == [("compile", "float32"),
                                                                                ("compile", "bfloat16")]
    widths = Axis("verify_width", (8, 4), per_bucket=True).candidates(start, [1, 4])
    assert [c.verify_width for c in widths] == [((1, 8), (4, 4)), ((1, 4), (4, 8))]


def test_the_core_count_is_part_of_the_key(tmp_path, monkeypatch, reference_pair):
    """The same CPU with fewer cores is another machine to tune for: its name (so its file) differs,
    and knobs tuned with 4 cores are not applied in a process that may use 2."""
    from dflow_rt.config import DEVICE_DEFAULTS

    def with_cores(n: int) -> None:
        monkeypatch.setattr(configs.os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)
        monkeypatch.setattr(configs.os, "cpu_count", lambda: n)

    monkeypatch.setattr(configs, "cpu_model", lambda: "AMD EPYC 9654 96-Core Processor")
    monkeypatch.setattr(configs, "tuned_dir", lambda directory=None: tmp_path)
    names = {}
    for n in (2, 4, 64):
        with_cores(n)
        names[n] = configs.device_name("cpu")
    assert len({configs.device_key(name) for name in names.values()}) == 3, names
    assert all(name.startswith("AMD EPYC 9654") for name in names.values())

    knobs = {"mode": "eager", "threads": 4, "length_step": None, "buckets": {"1": {"verify_width": 5}}}
    store({"dtype": "float32", "knobs": {"float32": knobs}}, entry_key(TARGET, DRAFTER), names[4], tmp_path)
    target, drafter = reference_pair
    with_cores(4)
    assert load_tuned(TARGET, DRAFTER).threads == 4
    assert resolve(RuntimeConfig(max_batch=2), target, drafter).verify_width == {1: 5, 2: 5}
    with_cores(2)
    assert load_tuned(TARGET, DRAFTER) is None
    cpu = DEVICE_DEFAULTS["cpu", "float32"]
    resolved = resolve(RuntimeConfig(max_batch=2), target, drafter)
    assert (resolved.mode, resolved.verify_width) == (cpu["mode"], cpu["verify_width"])
