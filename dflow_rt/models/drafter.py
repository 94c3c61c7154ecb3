"""The DFlash drafter: a few Qwen3-style layers that draft a whole block in one pass.

Block tokens `[last committed, MASK, ...]` are embedded with the target's table; target
features of committed positions go through `fc` + `hidden_norm` and are put in front of the
block as extra keys/values in every layer (each layer projects them with its own k/v).
Queries come from the block only and see every committed position plus the whole block.
Logits come from the target's `lm_head`; the drafter owns neither table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from dflow_rt.kernels.cpu.ops import Linear, embedding, linear
from dflow_rt.models.layers import CachedPass, DecoderLayer, KVCache, RMSNorm, Rotary
from dflow_rt.models.relay import Relay, VerifyRecord, relay_keys, relay_mask, shift_to_slots

RELAY_INPUTS = ("mask_embedding", "kv")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default choice of conditioning layers: spread evenly, skipping the first and last few."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    relay_hidden: int = 0  # DFlow boundary-correction MLP width; 0 = a DFlash drafter (no relay)
    relay_input: str = "mask_embedding"  # or "kv": where the relay enters the draft pass (models/relay.py)
    draft_whole_block: bool = False  # draft passes span the block at any verify width (`Drafter.propose`)

    def __post_init__(self):
        if self.relay_input not in RELAY_INPUTS:
            raise ValueError(f"relay_input must be one of {', '.join(RELAY_INPUTS)}, got {self.relay_input!r}")


class Drafter(nn.Module):
    kernel = True  # the draft-vocabulary head's product through the C++ kernel where it serves (`cpu_ops.route`)

    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = self.config = config
        self.layers = nn.ModuleList(
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                         c.head_dim, c.rms_norm_eps, True, c.attention_bias)
            for _ in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        self.relay = Relay(c.hidden_size, c.relay_hidden) if c.relay_hidden else None
        self.use_relay = self.relay is not None  # switch off to ablate the relay at inference
        # draft vocabulary (`restrict_vocab`): token ids and the target head's rows for them
        self.register_buffer("vocab_ids", None, persistent=False)
        self.register_buffer("vocab_head", None, persistent=False)
        self.vocab_codes = None  # the head's exact codes, once `exact_codes.attach` finds them

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    # The drafter runs in its own dtype, which may differ from the target's (a bf16 target under a
    # float32 drafter in training): values cross over at the target's embeddings, features and head.
    def embed(self, target: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The target's (frozen, shared) embeddings of `ids`, in the drafter's dtype."""
        return target.embed_tokens(ids).to(self.fc.weight.dtype)

    def logits(self, target: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Scores of drafter hidden states from the target's (frozen, shared) head, in the target's
        dtype: over the draft vocabulary when the drafter has one (column j is token `vocab_ids[j]`)."""
        if self.vocab_head is None:
            return target.lm_head(hidden.to(target.lm_head.weight.dtype))
        return linear(hidden.to(self.vocab_head.dtype), self.vocab_head, codes=self.vocab_codes, kernel=self.kernel)

    def restrict_vocab(self, target: nn.Module, ids: torch.Tensor | None) -> None:
        """Draft only tokens `ids` (None: the whole vocabulary again); see `dflow_rt.models.draft_vocab`.
        The head rows are copied once here, so a draft pass reads only them."""
        if ids is None:
            self.vocab_ids = self.vocab_head = self.vocab_codes = None
            return
        weight = target.lm_head.weight
        self.vocab_ids = ids.to(weight.device)
        with torch.no_grad():  # the head's rows (decoded where it is held as its codes)
            rows = embedding(self.vocab_ids, weight, getattr(target.lm_head, "codes", None))
        self.vocab_head = rows.detach().contiguous()
        self.vocab_codes = None

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids of `logits` columns."""
        return columns if self.vocab_ids is None else self.vocab_ids[columns]

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """`logits` columns of token `ids`: -1 for a token outside the draft vocabulary."""
        if self.vocab_ids is None:
            return ids
        index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        index[self.vocab_ids] = torch.arange(len(self.vocab_ids), device=ids.device)
        return index[ids]

    def greedy(self, target: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens of drafter hidden states, over the draft vocabulary if it has one."""
        return self.token_ids(self.logits(target, hidden).argmax(-1))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c, w = self.config, self.fc.weight
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim, w.dtype, w.device)

    def new_verify_record(self, batch: int, block_size: int | None = None) -> VerifyRecord:
        w = self.fc.weight
        return VerifyRecord.allocate(batch, block_size or self.block_size, w.shape[1], w.dtype, w.device)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., K*hidden] -> `hidden_norm(fc(features))` [..., hidden], what both the
        context keys/values and the relay are made of."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def relay_vectors(self, target: nn.Module, buffer: VerifyRecord, rows: torch.Tensor | None,
                      projected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-slot relay vectors [batch, B, hidden] (zero where nothing is relayed) and which
        slots carry one [batch, B]. `projected`: the buffer's features through `project`, when the
        caller has them already (the static round, whose context is the same features); its first
        n rows give the first n slots, enough for a verify of at most n positions."""
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        if projected is None:
            projected = self.project(pick(buffer.features))
        u, valid = shift_to_slots(projected, pick(buffer.accepted), pick(buffer.width))
        relay = self.relay(u, self.embed(target, pick(buffer.bonus)), self.embed(target, pick(buffer.rejected)))
        return relay * valid[..., None].to(relay.dtype), valid

    def write_context(self, ctx_feat: torch.Tensor, ctx_pos: torch.Tensor, cache: KVCache,
                      rows: torch.Tensor | None) -> torch.Tensor:
        """Project target features [batch, n, K*hidden] of positions `ctx_pos` into every layer's
        cache; returns the projected features.

        Context features are not transformed layer to layer: each layer applies its own
        k/v projections to the same `project(features)`.
        """
        ctx = self.project(ctx_feat)
        cos, sin = self.rotary(ctx_pos, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)
            cache.write(i, rows, ctx_pos, k, v)
        return ctx

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor, *, cache: KVCache,
                ctx_feat: torch.Tensor | None = None, ctx_pos: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, relay_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention: Callable | None = None) -> torch.Tensor:
        """Hidden states [batch, block, hidden] of one draft pass.

        `ctx_feat` (or None) are target features of newly committed positions `ctx_pos`,
        written to `cache` first. The block's own keys/values then go to `cache` at
        `block_pos`, and the block attends over every position before its end: the committed
        context and the whole block. Block entries are scratch: the positions a later round
        reads as context are rewritten by that round's context write first (the rejected ones
        sit at or past its block and are overwritten or masked). `relay_kv` = (relay vectors,
        valid slots) of a `kv` relay: extra keys/values for the block (`relay_keys`).
        `attention` (q, k, v, start, causal), a block attention kernel of `dflow_rt.kernels`,
        replaces the masked SDPA over the cache.
        """
        if ctx_feat is not None:
            self.write_context(ctx_feat, ctx_pos, cache, rows)
        cos, sin = self.rotary(block_pos, block_emb.dtype)
        size = block_pos.shape[1]
        cached = CachedPass.build(cache, rows, block_pos, (cos, sin), False, attention)
        if relay_kv is not None:
            relay_kv = relay_kv[0], relay_mask(relay_kv[1], size)
        h = block_emb
        for i, layer in enumerate(self.layers):
            def attend(attn, x, i=i):
                extra = None if relay_kv is None else relay_keys(attn, *relay_kv, cos, sin)
                return cached.attend(i, attn, x, extra)

            h = layer(h, attend)
        return self.norm(h)

    def propose(self, target: nn.Module, block_ids: torch.Tensor, block_pos: torch.Tensor, *, cache: KVCache,
                ctx_feat: torch.Tensor | None = None, ctx_pos: torch.Tensor | None = None,
                relay: VerifyRecord | None = None, projected: torch.Tensor | None = None,
                attention: Callable | None = None) -> torch.Tensor:
        """Greedy drafts [batch, n - 1] for slots 1.. of `block_ids` [batch, n] (one denoising step).

        `n` may be less than the block size (a verify of the first n; see `batched_round.draft`): the
        pass then spans those positions only, or, for a drafter with `draft_whole_block`, the whole
        block with its slots past n masked, which costs a little more and drafts what a full-width
        verify would (a drafter trained with soft labels leans on those masked slots;
        docs/experiments.md, "The whole block drafted, per drafter"). Either way only slots 1..n-1
        reach the head. With a DFlow relay and a `relay` buffer holding the last verify pass, the
        rejected suffix's features enter the pass (added to the mask embeddings, or as keys/values);
        `projected`: the buffer's first rows through `project`, when the caller has them (the static
        round, whose context write projects them). `attention`: see `forward`. Every row of `cache`
        and `relay` drafts.
        """
        n, size = block_ids.shape[1], self.block_size
        if self.config.draft_whole_block and n < size:
            masks = block_ids.new_full((block_ids.shape[0], size - n), self.config.mask_token_id)
            block_ids = torch.cat([block_ids, masks], dim=1)
            block_pos = block_pos[:, :1] + torch.arange(size, device=block_pos.device)
        emb, relay_kv = self.embed(target, block_ids), None
        if ctx_feat is not None:
            self.write_context(ctx_feat, ctx_pos, cache, None)
        if self.use_relay and relay is not None:
            vectors, valid = self.relay_vectors(target, relay, None, projected)
            span = block_ids.shape[1]  # a shorter pass: slots past it relay nothing it could use
            vectors, valid = vectors[:, :span], valid[:, :span]
            if vectors.shape[1] < span:  # a whole block past the buffer's rows: nothing relayed there
                pad = span - vectors.shape[1]
                vectors = torch.cat([vectors, vectors.new_zeros(vectors.shape[0], pad, vectors.shape[2])], dim=1)
                valid = torch.cat([valid, valid.new_zeros(valid.shape[0], pad)], dim=1)
            if self.config.relay_input == "kv":
                relay_kv = vectors, valid
            else:
                emb = emb + vectors
        h = self(emb, block_pos, cache=cache, relay_kv=relay_kv, attention=attention)
        return self.greedy(target, h[:, 1:n])


def with_relay(drafter: Drafter, relay_hidden: int, seed: int = 0, relay_input: str = "mask_embedding") -> Drafter:
    """A DFlow drafter from a DFlash one: same weights, a relay whose last projection is zero."""
    if relay_hidden < 1:
        raise ValueError(f"relay_hidden must be positive, got {relay_hidden}")
    w = drafter.fc.weight
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dflow = Drafter(replace(drafter.config, relay_hidden=relay_hidden, relay_input=relay_input))
    dflow.relay.zero_init()
    dflow.load_state_dict(drafter.state_dict(), strict=False)
    return dflow.to(device=w.device, dtype=w.dtype).eval()


@contextmanager
def relay_off(drafter: Drafter | None, off: bool = True) -> Iterator[None]:
    """Draft as the DFlash parent would (the relay ablation) inside the block; `off=False` keeps a
    DFlow drafter's relay on. The switch is restored on exit, also after an error."""
    if drafter is None:
        yield
        return
    before = drafter.use_relay
    drafter.use_relay = drafter.relay is not None and not off
    try:
        yield
    finally:
        drafter.use_relay = before
