"""Resource limits of a Runtime, checked before anything is allocated.

Every `RuntimeConfig` field is checked for its exact type and range (a size is an int, never a
float or bool), and the memory the preallocated state will take is compared with what the
device can give, so a bad configuration fails with one `InputError` naming the field instead
of an allocation failure halfway through construction, or a machine pushed into swap.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields

import torch

from dflow_rt.checks import check_int
from dflow_rt.config import AUTO, MODES, RuntimeConfig
from dflow_rt.errors import InputError
from dflow_rt.models.layers import Rotary, reserve_positions

MAX_ROWS = 1 << 16
MAX_LEN = 1 << 24
MAX_BLOCK = 1 << 10
RESERVE_FACTOR = 64  # a paged state's address space, in multiples of the memory it may use
GIB = 1 << 30


def _check_sizes(name: str, value: object, low: int, high: int) -> None:
    if value is None:
        return
    if not isinstance(value, (tuple, list)) or not value:
        raise InputError(f"{name} must be None or a non-empty tuple of ints, got {value!r}")
    for i, size in enumerate(value):
        check_int(f"{name}[{i}]", size, low, high)


def _verify_width(value: object, max_batch: int) -> None:
    if value is None or value == AUTO:
        return
    if isinstance(value, Mapping):
        for bucket, width in value.items():
            check_int("verify_width key (a batch bucket)", bucket, 1, max_batch)
            check_int(f"verify_width[{bucket}]", width, 1, MAX_BLOCK)
    else:
        check_int("verify_width", value, 1, MAX_BLOCK)


def _name(name: str, value: object, allowed: tuple[str, ...] | None = None) -> None:
    if type(value) is not str or not value or (allowed is not None and value not in allowed):
        choices = f"one of {', '.join(allowed)}" if allowed else "a non-empty string"
        raise InputError(f"{name} must be {choices}, got {value!r}")


def _kernels(value: object) -> None:
    """A kernel implementation for every op, or a dict op -> implementation (`kernels.selection.select`
    checks the names)."""
    if isinstance(value, Mapping):
        for op, name in value.items():
            _name("kernels op", op)
            _name(f"kernels[{op!r}]", name)
    else:
        _name("kernels", value)


# Per field: a check of its value, given the config whose max_batch and max_len are checked first.
FIELD_CHECKS: dict[str, Callable[[object, RuntimeConfig], object]] = {
    "max_batch": lambda v, c: check_int("max_batch", v, 1, MAX_ROWS),
    "max_len": lambda v, c: check_int("max_len", v, 2, MAX_LEN),
    "mode": lambda v, c: _name("mode", v, (*MODES, AUTO)),
    "block_size": lambda v, c: v is None or check_int("block_size", v, 1, min(MAX_BLOCK, c.max_len - 1)),
    "batch_buckets": lambda v, c: _check_sizes("batch_buckets", v, 1, c.max_batch),
    "length_buckets": lambda v, c: _check_sizes("length_buckets", v, 2, c.max_len),
    "compiler": lambda v, c: _name("compiler", v),
    "verify_width": lambda v, c: _verify_width(v, c.max_batch),
    "memory_limit": lambda v, c: v is None or check_int("memory_limit", v, 0),
    "kernels": lambda v, c: _kernels(v),
    "emit_mask_token": lambda v, c: _flag("emit_mask_token", v),
    "tuned": lambda v, c: _flag("tuned", v),
    "compile_cache": lambda v, c: _flag("compile_cache", v),
    "keep_timings": lambda v, c: _flag("keep_timings", v),
    "eager_start": lambda v, c: _flag("eager_start", v),
    "freeze": lambda v, c: _flag("freeze", v),
    "ar_fallback": lambda v, c: v == AUTO or _flag("ar_fallback", v),
    "sampling": lambda v, c: _flag("sampling", v),
    "lookup": lambda v, c: _flag("lookup", v),
    "prefill_chunk": lambda v, c: v is None or check_int("prefill_chunk", v, 1),
}


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be True or False, got {value!r}")


def check_config(c: object) -> RuntimeConfig:
    """`c` if every field has its type and range; else InputError naming the first bad field."""
    if not isinstance(c, RuntimeConfig):
        raise InputError(f"config must be a RuntimeConfig, got {type(c).__name__}")
    names = ["max_batch", "max_len"] + [f.name for f in fields(c) if f.name not in ("max_batch", "max_len")]
    for name in names:  # tests/test_limits.py checks that every field has an entry
        FIELD_CHECKS.get(name, lambda v, c: None)(getattr(c, name), c)
    return c


def cache_bytes(target, drafter, rows: int, max_len: int, block_size: int) -> dict[str, int]:
    """Bytes of the preallocated state per part: KV caches (layers x rows x kv_heads x (max_len + 1)
    x head_dim x 2 x dtype size, the + 1 a spare position that gives every length view the same
    strides), the verify record and the rotary tables' growth."""
    def kv(config, weight: torch.Tensor) -> int:
        return (config.num_hidden_layers * rows * config.num_key_value_heads * (max_len + 1) * config.head_dim * 2
                * weight.element_size())

    parts = {"target KV cache": kv(target.config, target.lm_head.weight)}
    if drafter is not None:
        w = drafter.fc.weight
        parts["drafter KV cache"] = kv(drafter.config, w)
        parts["verify record"] = rows * block_size * w.shape[1] * w.element_size()
    parts["rotary tables"] = sum(max(0, max_len - m.rotary.cos.shape[0]) * m.config.head_dim * 4 * 2
                                 for m in (target, drafter) if m is not None and isinstance(m.rotary, Rotary))
    return parts


def available_bytes(device: torch.device) -> int:
    """Free memory of `device`: free GPU memory, or MemAvailable of /proc/meminfo (free pages where
    there is no /proc)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(c: RuntimeConfig, target, drafter, block_size: int, paged: bool = False) -> int | None:
    """Check the state against `c.memory_limit` (default: free device memory) before anything is
    allocated. A dense state must fit whole; a paged one (`models.cache_pages`: resident as rows
    write it) must fit one row at max_len, and reserve at most RESERVE_FACTOR times the limit in
    address space. Returns what the rows' caches may hold at once (the limit less the rest of the
    state) where paged, else None (the state is resident already)."""
    parts = cache_bytes(target, drafter, c.max_batch, c.max_len, block_size)
    device = target.lm_head.weight.device
    limit = c.memory_limit if c.memory_limit is not None else available_bytes(device)
    source = "memory_limit" if c.memory_limit is not None else f"free memory on {device}"
    need = sum(parts.values())
    if not paged:
        if need > limit:
            detail = ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v)
            raise InputError(f"max_batch {c.max_batch} x max_len {c.max_len} needs {need / GIB:.2f} GiB ({detail}), "
                             f"more than the {limit / GIB:.2f} GiB of {source}: lower max_batch or max_len")
        return None
    caches = parts["target KV cache"] + parts.get("drafter KV cache", 0)
    rest = need - caches
    row = row_bytes(target, drafter, c.max_len)
    if rest + row > limit:
        raise InputError(f"one row of max_len {c.max_len} needs {(rest + row) / GIB:.2f} GiB with the rest of the "
                         f"state, more than the {limit / GIB:.2f} GiB of {source}: lower max_len")
    if caches > RESERVE_FACTOR * limit:
        raise InputError(f"max_batch {c.max_batch} x max_len {c.max_len} reserves {caches / GIB:.2f} GiB of address "
                         f"space, more than {RESERVE_FACTOR}x the {limit / GIB:.2f} GiB of {source}: lower max_batch "
                         f"or max_len")
    return limit - rest


def row_bytes(target, drafter, positions: int) -> int:
    """Resident bytes of one row's caches holding `positions` positions where the caches are paged, at
    most: each layer's keys and values per head, in whole pages, and one more where a head's span
    straddles a page boundary."""
    page = 4096
    total = 0
    for m in (target, drafter):
        if m is None:
            continue
        c, w = m.config, (m.lm_head.weight if m is target else m.fc.weight)
        per_head = (-(-positions * c.head_dim * w.element_size() // page) + 1) * page
        total += c.num_hidden_layers * 2 * c.num_key_value_heads * per_head
    return total


@contextmanager
def rotary_growth(length: int, *models) -> Iterator[None]:
    """Grow the rotary tables of `models` to `length` for the body; if the body fails, put the old
    tables back, so that a failed Runtime leaves the models it shares as they were."""
    before = [(m.rotary, m.rotary.cos, m.rotary.sin) for m in models if isinstance(getattr(m, "rotary", None), Rotary)]
    try:
        reserve_positions(length, *models)
        yield
    except BaseException:
        for rotary, cos, sin in before:
            rotary.cos, rotary.sin = cos, sin
        raise
