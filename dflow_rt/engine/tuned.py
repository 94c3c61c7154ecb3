"""Tuned runtime knobs on disk: where `dflow-rt autotune` writes them and how they are read back
(`engine.settings` applies them).

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

from dflow_rt.config import DTYPES, MODES

log = logging.getLogger(__name__)
FORMAT = 1


@dataclass(frozen=True)
class TunedConfig:
    """The knobs of one (target, drafter, device, dtype), and also a point of the job's search: what
    the job measures is exactly what `engine.settings.apply_tuned` gives a Runtime. Hashable, so widths are pairs.

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
