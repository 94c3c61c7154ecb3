"""Building blocks shared by the target and the drafter.

Parameter names follow Hugging Face (`self_attn.q_proj`, `mlp.gate_proj`, ...) so that
checkpoints load and save without a key map. Shapes: activations are [batch, seq, hidden];
per-head tensors are [batch, heads, seq, head_dim].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflow_rt.kernels.attention import cache_mask
from dflow_rt.kernels.cpu.ops import Codes, Linear, eager_served, linear_parts, rms_norm
from dflow_rt.models.cache_pages import Cache


class RMSNorm(nn.Module):
    kernel = True  # the C++ op in eager passes where it serves; False: torch's (`cpu_ops.route`)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.kernel)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with the `llama3` long-context rescaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables for integer `positions` [batch, seq] -> [batch, 1, seq, head_dim]."""
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


DEFAULT_POSITIONS = 4096  # rotary positions built at load; training sequences are shorter


class Rotary(nn.Module):
    """Rotary cos/sin tables, looked up by position.

    A lookup, not cos/sin evaluated per call: inductor fuses a pointwise producer into each
    consumer, so computed tables were re-evaluated inside every layer's kernel (9 % of a
    compiled batch-4 round on CPU). The tables are float32. Loading reserves at most
    `DEFAULT_POSITIONS` of the model's max_position_embeddings (a config may claim millions);
    `reserve` grows them outside the decoding loop to what a Runtime or `generate` needs.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, length: int):
        super().__init__()
        # Built on the CPU explicitly: loading constructs modules on the meta device.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.register_buffer("cos", torch.empty(0, head_dim, device="cpu"), persistent=False)
        self.register_buffer("sin", torch.empty(0, head_dim, device="cpu"), persistent=False)
        self.reserve(min(length, DEFAULT_POSITIONS))

    def reserve(self, length: int) -> None:
        """Make the tables cover positions 0..length-1."""
        if self.cos.shape[0] < length:
            positions = torch.arange(length, device=self.inv_freq.device)[None]
            cos, sin = rope_cos_sin(positions, self.inv_freq, torch.float32)
            half = sin.shape[-1] // 2
            self.cos, self.sin = cos[0, 0], torch.cat((-sin[0, 0, :, :half], sin[0, 0, :, half:]), dim=-1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [batch, 1, seq, head_dim] for integer `positions` [batch, seq], the sine with its
        first half negated: what `apply_rope` takes."""
        return self.cos[positions].to(dtype)[:, None], self.sin[positions].to(dtype)[:, None]


def reserve_positions(length: int, *models) -> None:
    """Grow the rotary tables of `models` (None and models without one are skipped) to `length`."""
    for model in models:
        rotary = getattr(model, "rotary", None)
        if isinstance(rotary, Rotary):
            rotary.reserve(length)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` by the angles of `cos` and `signed_sin`, the sine with its first half negated
    (`Rotary` gives it so): the HF rotation `x * cos + cat(-x2, x1) * sin` to the bit, in a roll
    and three ops instead of seven (an eager round rotates about 70 times)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class Attention(nn.Module):
    """Projections of one attention layer; how keys are gathered is the caller's business."""

    parts = ("q_proj", "k_proj", "v_proj")  # projections of one input: one product once `merged` is set
    merged: Codes | None = None  # their codes stacked (`dflow_rt.models.exact_codes.attach`)

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 qk_norm: bool, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q: torch.Tensor | None = None) -> torch.Tensor:
        """Rotated queries of `x` (`q`: its projection, when the caller has it already)."""
        q = (self.q_proj(x) if q is None else q).unflatten(-1, (self.heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Rotated keys and values of `x` (`kv`: its projections, when the caller has them already)."""
        k, v = (self.k_proj(x), self.v_proj(x)) if kv is None else kv
        k = k.unflatten(-1, (self.kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = v.unflatten(-1, (self.kv_heads, self.head_dim))
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def rotate_and_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, cache: KVCache, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """`query` and `key_value` over the projections q, k, v, and the keys' and values' write to every
        row of `cache` at `positions`, as one C++ op (`kernels/cpu/eager.cpp`): about twenty small ops less a
        layer, for eager passes (`cpu_ops.eager_served`). Returns the rotated queries."""
        q = q.unflatten(-1, (self.heads, self.head_dim))
        k, v = (t.unflatten(-1, (self.kv_heads, self.head_dim)) for t in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return torch.ops.dflow_rt.rope_write(q, k, v, cos, sin, cache.k[layer], cache.v[layer], positions)

    def output(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               extra: tuple | None = None, kernel: Callable | None = None) -> torch.Tensor:
        """Attend `q` over `k`/`v` where `mask` [batch, q_len, k_len] is True, then project out.

        `extra` = (k, v, mask): a second attention with a softmax of its own, added to the
        first before the output projection (the DFlow `kv` relay). `kernel(q, k, v)`, when
        given, is the first attention instead (a fused kernel that knows its mask; `mask` unused).
        """
        if kernel is not None:
            out = kernel(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
        if extra is not None:
            ek, ev, emask = extra
            out = out + F.scaled_dot_product_attention(q, ek, ev, attn_mask=emask[:, None], enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


@dataclass
class CachedPass:
    """One forward pass over a static KV cache: the rows and positions its tokens are written
    to, their rotary angles, and what they attend to (`cache_mask`, or a fused block-attention
    kernel of `dflow_rt.kernels` that knows the mask from the first position)."""

    cache: KVCache
    rows: torch.Tensor | None
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    kernel: Callable | None

    @classmethod
    def build(cls, cache: KVCache, rows: torch.Tensor | None, positions: torch.Tensor, rope: tuple,
              causal: bool, attention: Callable | None = None) -> CachedPass:
        """`rope` = (cos, sin) of `positions`; `attention(q, k, v, start, causal)` replaces the masked SDPA."""
        if attention is not None:
            kernel = functools.partial(attention, start=positions[:, 0], causal=causal)
            return cls(cache, rows, positions, *rope, None, kernel)
        return cls(cache, rows, positions, *rope, cache_mask(positions, cache.max_len, causal), None)

    def attend(self, layer: int, attn: Attention, x: torch.Tensor, extra: tuple | None = None) -> torch.Tensor:
        """Write the keys/values of `x` to the cache, then attend over the whole cache (see
        `Attention.output` for `extra`).

        The cache stays one tensor per layer that attention reads in place: no concatenation of
        old and new keys, whose copy grows with the context every round.
        """
        q, k, v = linear_parts(x, (attn.q_proj, attn.k_proj, attn.v_proj), attn.merged)
        if self.rows is None and eager_served(x, attn.q_proj.weight, attn.q_proj.kernel):
            q = attn.rotate_and_write(q, k, v, self.cos, self.sin, self.cache, layer, self.positions)
        else:
            k, v = attn.key_value(x, self.cos, self.sin, (k, v))
            self.cache.write(layer, self.rows, self.positions, k, v)
            q = attn.query(x, self.cos, self.sin, q)
        k, v = self.cache.read(layer, self.rows)
        return attn.output(q, k, v, self.mask, extra, self.kernel)


class MLP(nn.Module):
    parts = ("gate_proj", "up_proj")  # see Attention.parts
    merged: Codes | None = None

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear_parts(x, (self.gate_proj, self.up_proj), self.merged)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; `attend` maps normed input to the attention output."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 eps: float, qk_norm: bool, attention_bias: bool, mlp_bias: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps, qk_norm, attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate, mlp_bias)

    def forward(self, h: torch.Tensor, attend) -> torch.Tensor:
        h = h + attend(self.self_attn, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class KVCache:
    """Static key/value storage: per layer, [batch, kv_heads, max_len, head_dim].

    Entries are addressed by absolute position. Rollback is bookkeeping: a stale entry is
    never read because masks admit only positions the caller knows to be valid. One tensor
    per layer (not one 5-D tensor) so that a write is an in-place index_put on a whole graph
    input: through a per-layer view, torch.compile rewrote it as a copy of the entire cache.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        # One spare position that nothing addresses: every length view, the full one included,
        # then has the same strides, so one compiled graph (symbolic length) serves them all.
        # On CPU the pages of a row are resident only once written (`cache_pages`).
        shape = (batch, kv_heads, max_len + 1, head_dim)
        self.pages = [Cache(shape, dtype, device) for _ in range(2 * layers)]
        self.k = [c.tensor[:, :, :max_len] for c in self.pages[:layers]]
        self.v = [c.tensor[:, :, :max_len] for c in self.pages[layers:]]
        self.all_rows = torch.arange(batch, device=device)

    def release(self, row: int, zero: bool = False) -> None:
        """Give back the memory `row` holds where it is held in pages (`cache_pages`), which then read as
        zeros (a request's row, when it ends); with `zero`, zeros in any case (a faulted row)."""
        for c in self.pages:
            c.release(row, zero)

    @property
    def max_len(self) -> int:
        """Positions this cache (or view) holds; read off a tensor so that compiled code can
        treat it as a symbolic size."""
        return self.k[0].shape[2]

    def write(self, layer: int, rows: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k/v [batch, kv_heads, seq, head_dim] at `positions` [batch, seq] of cache `rows`.

        `rows=None` means every row in order (the static batched round).
        """
        idx = (self.all_rows[:, None] if rows is None else rows[:, None], slice(None), positions)
        self.k[layer][idx] = k.transpose(1, 2)
        self.v[layer][idx] = v.transpose(1, 2)

    def view(self, n: int, length: int | None = None) -> KVCache:
        """The first `n` rows and `length` positions, sharing storage: what one round of a
        (batch, length) bucket reads and writes, so attention spans live positions only."""
        out = object.__new__(KVCache)
        out.k, out.v = [t[:n, :, :length] for t in self.k], [t[:n, :, :length] for t in self.v]
        out.all_rows, out.pages = self.all_rows[:n], []
        return out

    def read(self, layer: int, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if rows is None:
            return self.k[layer], self.v[layer]
        return self.k[layer][rows], self.v[layer][rows]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.k, *self.v]
