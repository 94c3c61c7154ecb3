"""A Runtime's settings, resolved once and in one place: a setting given explicitly wins, then what
`dflow-rt autotune` wrote for these models on this device (`engine.tuned` reads the file), then the
per-device defaults (`config.DEVICE_DEFAULTS`). Commands pass their flags as explicit settings and
leave the rest "auto"; the Runtime calls `resolve_config` before it allocates anything."""

from __future__ import annotations

import dataclasses

from dflow_rt.config import AUTO, DEVICE_DEFAULTS, RuntimeConfig
from dflow_rt.engine.limits import check_config
from dflow_rt.engine.tuned import TunedConfig, load_tuned


def apply_tuned(config: RuntimeConfig, tuned: TunedConfig | None, block_size: int | None = None) -> RuntimeConfig:
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


def resolve_config(config: RuntimeConfig, target, drafter=None) -> RuntimeConfig:
    """The one resolver: `config` checked, then every "auto" field chosen for these models where they
    sit. An explicit setting wins; then the autotune file's knobs when `config.tuned` finds some (for
    the models' source directories, device and dtype); then DEVICE_DEFAULTS for the device and dtype
    (a default verify width no wider than the block: 1 without a drafter). The fallback to plain
    steps is the Runtime's only where the verify width is too: a width given is a width kept. What
    it returns needs no second check: tuned knobs are checked when read, defaults are constants."""
    c = check_config(config)
    if c.ar_fallback == AUTO and c.verify_width != AUTO:
        c = dataclasses.replace(c, ar_fallback=False)
    if c.tuned and AUTO in (c.mode, c.verify_width, c.kernels):
        c = _tuned_for(c, target, drafter)
    weight = target.lm_head.weight
    dtype = str(weight.dtype).removeprefix("torch.")
    defaults = DEVICE_DEFAULTS.get((weight.device.type, dtype)) or DEVICE_DEFAULTS.get((weight.device.type, None))
    defaults = dict(defaults or {"mode": "eager", "verify_width": None, "ar_fallback": False})
    defaults["ar_fallback"] &= drafter is not None
    block = c.block_size or (drafter.block_size if drafter is not None else 1)
    if defaults["verify_width"] is not None:
        defaults["verify_width"] = min(defaults["verify_width"], block)
    return dataclasses.replace(c, **{k: v for k, v in defaults.items() if getattr(c, k) == AUTO})


def _tuned_for(config: RuntimeConfig, target, drafter=None) -> RuntimeConfig:
    """`config` with the knobs tuned for these loaded models (identified by the directories they were
    loaded from, in the dtype and on the device they sit on)."""
    weight = target.lm_head.weight
    tuned = load_tuned(getattr(target, "source", None), getattr(drafter, "source", None) if drafter else None,
                       weight.device, str(weight.dtype).removeprefix("torch."))
    block = config.block_size or (drafter.block_size if drafter is not None else 1)
    return apply_tuned(config, tuned, block)
