"""Tuned runtime knobs on disk: where `dflow-rt autotune` writes them, and how a Runtime or the CLI
reads them at start.

One JSON file per device (`<config dir>/tuned/<device key>.json`), one entry per (target, drafter)
pair, knobs per dtype and per batch bucket. The Runtime imports this module when it starts, so it
imports neither the Runtime nor the job (the job imports the Runtime).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

from dflow_rt.config import AUTO, DEVICE_DEFAULTS, DTYPES, MODES, RuntimeConfig

log = logging.getLogger(__name__)
FORMAT = 1


@dataclass(frozen=True)
class TunedConfig:
    """The knobs of one (target, drafter, device, dtype), and also a point of the job's search: what
    the job measures is exactly what `apply` gives a Runtime. Hashable, so widths are pairs.

    verify_width: (batch bucket, k) pairs; empty = the whole block everywhere.
    length_step: spacing of the length buckets; None = RuntimeConfig's default.
    kernels: RuntimeConfig.kernels; None = leave it alone.
    threads, dtype: model-level knobs that `dflow-rt generate --tuned` applies when it loads the models.
    """

    dtype: str
    threads: int
    mode: str = "eager"
    verify_width: tuple[tuple[int, int], ...] = ()
    length_step: int | None = None
    kernels: str | None = None
    path: Path | None = field(default=None, compare=False)

    def knobs(self) -> dict:
        """The knobs as JSON-ready values (no path)."""
        out = dataclasses.asdict(self)
        out.pop("path")
        out["verify_width"] = {str(n): k for n, k in self.verify_width}
        return out


def config_root() -> Path:
    """`$DFLOW_RT_CONFIG`, else `${XDG_CONFIG_HOME:-~/.config}/dflow-rt`; read at call time, so tests can move it."""
    if os.environ.get("DFLOW_RT_CONFIG"):
        return Path(os.environ["DFLOW_RT_CONFIG"]).expanduser()
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config").expanduser() / "dflow-rt"


def tuned_dir(directory: str | Path | None = None) -> Path:
    return Path(directory).expanduser() if directory else config_root() / "tuned"


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def device_name(device: object = "cpu") -> str:
    """What tuned knobs are keyed by: the GPU's name, or the CPU's name and the cores this process may use
    (the same CPU with fewer cores is a different machine to tune for)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()} ({cores} cores)"


def device_key(name: str) -> str:
    """A file name for a device name: 'AMD EPYC (2 cores)' -> 'amd-epyc-2-cores'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def model_id(spec: str | Path | None) -> str:
    """'<directory name>-<hash of its config.json>' for a model directory, 'none' for no model, else `spec`
    as given (an id already). The hash tells apart two checkpoints that share a directory name."""
    if spec is None:
        return "none"
    config = Path(spec) / "config.json"
    if config.is_file():
        return f"{Path(spec).resolve().name}-{hashlib.sha256(config.read_bytes()).hexdigest()[:10]}"
    return str(spec)


def entry_key(target: str | Path | None, drafter: str | Path | None) -> str:
    return f"{model_id(target)}+{model_id(drafter)}"


def load_tuned(target: str | Path | None, drafter: str | Path | None, device: object = "cpu",
               dtype: str | None = None, directory: str | Path | None = None) -> TunedConfig | None:
    """The tuned knobs for these models on this device (in `dtype`, else the dtype the job chose), or None
    for the runtime defaults. Logs which file it used, or why it fell back."""
    path = tuned_dir(directory) / f"{device_key(device_name(device))}.json"
    key = entry_key(target, drafter)
    try:
        entry = json.loads(path.read_text())["entries"].get(key)
        if entry is None:
            log.info("autotune: %s has no entry for %s: runtime defaults", path, key)
            return None
        dtype = dtype or entry["dtype"]
        knobs = entry["knobs"].get(dtype)
        if knobs is None:
            log.info("autotune: %s has no %s knobs for %s: runtime defaults", path, dtype, key)
            return None
        widths = tuple(sorted((int(n), int(b["verify_width"])) for n, b in knobs["buckets"].items()
                              if b.get("verify_width") is not None))
        mode = knobs["mode"] if "mode" in knobs else knobs["backend"]  # files written before the rename
        tuned = TunedConfig(dtype, int(knobs["threads"]), mode, widths, knobs.get("length_step"),
                            knobs.get("kernels"), path)
        step, kernels = tuned.length_step, tuned.kernels
        if (tuned.dtype not in DTYPES or tuned.mode not in MODES or tuned.threads < 1
                or any(k < 1 for _, k in widths) or not (step is None or type(step) is int and step >= 1)
                or not (kernels is None or isinstance(kernels, str))):
            raise ValueError(f"a knob out of range in {knobs}")
    except FileNotFoundError:
        log.info("autotune: no tuned file %s: runtime defaults", path)
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("autotune: ignoring unreadable or invalid tuned file %s (%s): runtime defaults", path, err)
        return None
    log.info("autotune: using %s knobs for %s from %s", dtype, key, path)
    return tuned


def apply(config: RuntimeConfig, tuned: TunedConfig | None, block_size: int | None = None) -> RuntimeConfig:
    """`config` with the tuned mode, verify widths and kernels where it left them "auto" (an
    explicit setting wins), and the tuned length spacing unless it names its own length buckets
    (explicit buckets are usually a memory decision). A batch bucket the job did not measure takes
    the width of the nearest measured one below it (else the smallest); widths are capped at
    `block_size` when given (a smaller --block-size than the drafter's)."""
    if tuned is None:
        return config
    changes: dict = {}
    if config.mode == AUTO:
        changes["mode"] = tuned.mode
    if config.verify_width == AUTO:
        if config.ar_fallback == AUTO:  # the widths are the Runtime's choice, so is leaving them
            changes["ar_fallback"] = tuned.mode != "cudagraph"
        changes["verify_width"] = None  # the job measured the whole block
        if tuned.verify_width:
            measured = dict(tuned.verify_width)
            below = {n: max((m for m in measured if m <= n), default=min(measured)) for n in config.buckets()}
            changes["verify_width"] = {n: min(measured[m], block_size or measured[m]) for n, m in below.items()}
    if tuned.length_step and config.length_buckets is None:
        step = tuned.length_step
        changes["length_buckets"] = tuple(range(max(step, 128), config.max_len, step)) or None
    if tuned.kernels is not None and config.kernels == AUTO:
        changes["kernels"] = tuned.kernels
    return dataclasses.replace(config, **changes)


def tuned_for(config: RuntimeConfig, target, drafter=None) -> RuntimeConfig:
    """The Runtime's hook: `config` with the knobs tuned for these loaded models (identified by the
    directories they were loaded from, in the dtype and on the device they sit on)."""
    weight = target.lm_head.weight
    tuned = load_tuned(getattr(target, "source", None), getattr(drafter, "source", None) if drafter else None,
                       weight.device, str(weight.dtype).removeprefix("torch."))
    block = config.block_size or (drafter.block_size if drafter is not None else 1)
    return apply(config, tuned, block)


def resolve(config: RuntimeConfig, target, drafter=None) -> RuntimeConfig:
    """`config` with every "auto" field chosen for these models where they sit: the autotune file's
    knobs when `config.tuned` finds some, else DEVICE_DEFAULTS for the device and dtype (a default
    verify width no wider than the block: 1 without a drafter). The fallback to plain steps is the
    Runtime's only where the verify width is too: a width given is a width kept."""
    c = config
    if c.ar_fallback == AUTO and c.verify_width != AUTO:
        c = dataclasses.replace(c, ar_fallback=False)
    if c.tuned and AUTO in (c.mode, c.verify_width, c.kernels):
        c = tuned_for(c, target, drafter)
    weight = target.lm_head.weight
    dtype = str(weight.dtype).removeprefix("torch.")
    defaults = DEVICE_DEFAULTS.get((weight.device.type, dtype)) or DEVICE_DEFAULTS.get((weight.device.type, None))
    defaults = dict(defaults or {"mode": "eager", "verify_width": None, "ar_fallback": False})
    defaults["ar_fallback"] &= drafter is not None
    block = c.block_size or (drafter.block_size if drafter is not None else 1)
    if defaults["verify_width"] is not None:
        defaults["verify_width"] = min(defaults["verify_width"], block)
    return dataclasses.replace(c, **{k: v for k, v in defaults.items() if getattr(c, k) == AUTO})


def store(entry: dict, key: str, device: str, directory: str | Path | None = None) -> Path:
    """Write `entry` under `key` into the file of `device` (a device name), keeping the file's other
    entries; atomically, so a reader never sees half a file. Returns the file's path."""
    path = tuned_dir(directory) / f"{device_key(device)}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("device") != device or not isinstance(data["entries"], dict):
            raise ValueError("another format or device")
    except FileNotFoundError:
        data = None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("autotune: replacing unreadable tuned file %s (%s)", path, err)
        data = None
    data = data or {"format": FORMAT, "device": device, "entries": {}}
    data["entries"][key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path
