"""Bounds on what a checkpoint may ask for, checked before anything is built or read.

A config.json is untrusted input whose sizes decide how much memory loading takes (modules,
rotary tables, tensors). Every size has a ceiling far above any real model, and the
parameters the config describes must be in the weight files it comes with (whose reading is
bounded by their size), so a config claiming a trillion parameters beside a 1 MB file is
refused before a single module exists. Files are opened only when they are regular files:
a FIFO would block the loader forever, and a device could be read without end.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dflow_rt.errors import CheckpointError
from dflow_rt.models.drafter import DrafterConfig
from dflow_rt.models.target import TargetConfig

# Ceilings of config sizes: several times the largest public models, far below what would exhaust memory.
LIMITS = {"hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
          "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024, "vocab_size": 1 << 22,
          "max_position_embeddings": 1 << 24, "block_size": 1024, "num_target_layers": 1024,
          "relay_hidden": 1 << 18}
DEFAULT_LIMIT = 1 << 24  # any other integer field
MAX_JSON_BYTES = 64 << 20  # config.json or a shard index


def bound(name: str, value: int, path: object) -> int:
    """`value` if it is within the ceiling of field `name`; else CheckpointError."""
    cap = LIMITS.get(name, DEFAULT_LIMIT)
    if value > cap:
        raise CheckpointError(path, f"field '{name}' is {value}, above the bound {cap} for this field")
    return value


def regular_file(path: Path, limit: int | None = None) -> int:
    """The size of `path` after checking (with stat, without opening it) that it is a regular file
    of at most `limit` bytes."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except OSError as err:
        raise CheckpointError(path, f"cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(path, "not a regular file (a FIFO, device or directory is never opened)")
    if limit is not None and info.st_size > limit:
        raise CheckpointError(path, f"{info.st_size} bytes, more than the {limit} a JSON file here may have")
    return info.st_size


def _layer_parameters(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, qk_norm: bool,
                      attention_bias: bool, mlp_bias: bool) -> int:
    """Parameters of one `DecoderLayer`: q/k/v/o projections, gate/up/down, two norms, optional
    q/k norms and biases."""
    q, kv = heads * head_dim, kv_heads * head_dim
    n = 2 * hidden * q + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden
    n += (q + 2 * kv + hidden) * attention_bias + (2 * intermediate + hidden) * mlp_bias + 2 * head_dim * qk_norm
    return n


def parameter_count(c: TargetConfig | DrafterConfig) -> int:
    """Parameters a config describes, as the weight files hold them: a tied target stores no
    lm_head, a drafter has no embeddings or head of its own."""
    target = isinstance(c, TargetConfig)
    per_layer = _layer_parameters(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                  c.intermediate_size, c.qk_norm if target else True, c.attention_bias,
                                  target and c.mlp_bias)
    n = c.num_hidden_layers * per_layer + c.hidden_size  # layers and the final norm
    if target:
        return n + c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    n += len(c.target_layer_ids) * c.hidden_size * c.hidden_size + c.hidden_size  # fc and hidden_norm
    if c.relay_hidden:
        n += (3 * c.hidden_size + 1) * c.relay_hidden + (c.relay_hidden + 1) * 2 * c.hidden_size
    return n


def check_parameters(config: TargetConfig | DrafterConfig, elements: int, path: object) -> None:
    """Refuse a config that describes over twice the parameters of the weight files (`elements`).

    Below that, building the module on the meta device costs little and the per-tensor checks
    name the exact tensor at fault; above it, a size field is grossly wrong."""
    need = parameter_count(config)
    if need > 2 * elements:
        raise CheckpointError(path, f"describes {need:,} parameters, but the weight files hold {elements:,}: "
                                    f"a size field is wrong")
