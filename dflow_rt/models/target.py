"""The target LLM: a Qwen3 / Llama decoder over a static KV cache that also returns the
hidden states of chosen layers (the drafter's conditioning).

`features` are outputs of decoder layers `layer_ids` concatenated on the last axis: HF's
`hidden_states[l + 1]`. HF's last entry is taken AFTER the final norm, and DFlash drafters are
trained on exactly that, so the last layer's feature is its normed output (`Target.features`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dflow_rt.kernels.cpu.ops import Embedding, Linear
from dflow_rt.models.layers import CachedPass, DecoderLayer, KVCache, RMSNorm, Rotary

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "qwen3"

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either `rope_theta`+`rope_scaling` or the newer `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10_000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


class Target(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        c = self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(c.vocab_size, c.hidden_size)  # rows from codes, where held as them
        self.model.layers = nn.ModuleList(
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                         c.head_dim, c.rms_norm_eps, c.qk_norm, c.attention_bias, c.mlp_bias)
            for _ in range(c.num_hidden_layers)
        )
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c, w = self.config, self.lm_head.weight
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim, w.dtype, w.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                rows: torch.Tensor | None = None, *, layer_ids: tuple[int, ...] = (), logits_from: int = 0,
                attention: Callable | None = None):
        """Run `ids` [batch, seq] at `positions` [batch, seq], causally.

        With a `cache`, keys/values are written to cache `rows` [batch] and each token sees the
        cache entries at positions up to its own; without one (training), the sequence sees
        only itself. `attention` (q, k, v, start, causal), a block attention kernel of
        `dflow_rt.kernels`, replaces the masked SDPA over the cache; each row's positions must
        then run on from positions[:, 0]. Returns (logits of positions `logits_from:`, features
        [batch, seq, len(layer_ids) * hidden] or None).
        """
        h = self.model.embed_tokens(ids)
        cos, sin = self.rotary(positions, h.dtype)
        if cache is not None:
            cached, mask = CachedPass.build(cache, rows, positions, (cos, sin), True, attention), None
        else:
            cached, mask = None, positions[:, None, :] <= positions[:, :, None]
        picked = {}
        for i, layer in enumerate(self.model.layers):
            def attend(attn, x, i=i):
                if cached is not None:
                    return cached.attend(i, attn, x)
                k, v = attn.key_value(x, cos, sin)
                return attn.output(attn.query(x, cos, sin), k, v, mask)

            h = layer(h, attend)
            if i in layer_ids:
                picked[i] = h
        return self.lm_head(self.model.norm(h[:, logits_from:])), self.features(picked, layer_ids)

    def features(self, picked: dict[int, torch.Tensor], layer_ids: tuple[int, ...]) -> torch.Tensor | None:
        """Outputs of layers `layer_ids` (from `picked`) side by side, the last layer's after the
        final norm: HF `hidden_states[l + 1]` for every l, as the DFlash reference feeds its drafter."""
        last = self.config.num_hidden_layers - 1
        parts = [self.model.norm(picked[i]) if i == last else picked[i] for i in layer_ids]
        return torch.cat(parts, dim=-1) if parts else None
