"""DFlash and DFlow drafter training on target-regenerated sequences (arXiv 2602.06036, 2609.06498).

DFlash: random anchors p per sequence; block `[x_p, MASK x (B-1)]` at positions p..p+B-1 sees the
frozen target's features of positions STRICTLY before p (the anchor's feature does not exist yet at
inference), itself bidirectionally and no other block; slot k predicts x_{p+k} (same position), slot 0
is unsupervised; CE weighted exp(-(k-1)/gamma). A sequence's anchor blocks share one context
projection and attend under one [N*B, ctx + N*B] mask: one target pass and one drafter pass a batch.

DFlow: that round unrolled 3 times per anchor with shared weights. Each round's greedy drafts are
verified ONLINE by the frozen target (the proposed block on top of the clean context, no_grad);
acceptance and the next anchor come from matching drafts against the ground truth; the next round's
mask slots get relays built by the inference code itself (`VerifyRecord.write`,
`Drafter.relay_vectors`), so slot mapping and c/d cannot drift from the runtime. Drafts are
argmax: no gradient crosses rounds. Round losses are summed; with `base_first_round` the shared
weights learn from round 1 (the DFlash loss) and the relay alone from the later rounds.

The batched forwards below reuse the models' modules (`key_value`/`query`/`output`); tests check
them against the inference forwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflow_rt.models.drafter import Drafter
from dflow_rt.models.layers import Rotary
from dflow_rt.models.relay import VerifyRecord, relay_keys, relay_mask
from dflow_rt.models.target import Target


def auto_gamma(block_size: int) -> float:
    """Loss decay: 7 at B = 16 (the public recipe), 4 at B = 8 (the planning runs' choice), linear between."""
    return max(1.0, 4.0 + (block_size - 8) * 3 / 8)


# ------------------------------------------------------------------------------------- forwards

def block_mask(ctx_len: int, starts: torch.Tensor, B: int, causal: bool) -> torch.Tensor:
    """[b, N*B, ctx_len + N*B]: block n sees context positions < starts[:, n] and only itself
    (bidirectionally for drafting, causally for verifying)."""
    b, N = starts.shape
    ctx = torch.arange(ctx_len, device=starts.device) < starts[..., None]
    ctx = ctx[:, :, None].expand(b, N, B, ctx_len).reshape(b, N * B, ctx_len)
    idx = torch.arange(N * B, device=starts.device)
    own = (idx[:, None] // B) == (idx[None, :] // B)
    if causal:
        own = own & (idx[None, :] <= idx[:, None])
    return torch.cat([ctx, own.expand(b, -1, -1)], dim=-1)


def run_layers(layers, h: torch.Tensor, pos: torch.Tensor, rotary: Rotary, mask: torch.Tensor,
               ctx_kv: list | None = None, record: list | None = None, pick: tuple[int, ...] = (), extra=None):
    """Decoder layers over `h` whose keys are [ctx_kv[i] ; own]; returns (h, {layer: output} of `pick`).
    `extra(attn, cos, sin)` gives a layer's second attention (`Attention.output`), if any."""
    cos, sin = rotary(pos, h.dtype)
    picked = {}
    for i, layer in enumerate(layers):
        def attend(attn, x, i=i):
            k, v = attn.key_value(x, cos, sin)
            if record is not None:
                record.append((k, v))
            if ctx_kv is not None:
                k, v = torch.cat([ctx_kv[i][0], k], dim=2), torch.cat([ctx_kv[i][1], v], dim=2)
            return attn.output(attn.query(x, cos, sin), k, v, mask, extra and extra(attn, cos, sin))

        h = layer(h, attend)
        if i in pick:
            picked[i] = h
    return h, picked


def target_context(target: Target, ids: torch.Tensor, layer_ids: tuple[int, ...]):
    """Clean causal pass up to the deepest conditioning layer: (features [b, L, K*H], per-layer K/V).
    Layers above it and the head are skipped: the drafter never reads them."""
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    kv: list = []
    _, picked = run_layers(target.model.layers[:max(layer_ids) + 1], target.embed_tokens(ids), pos, target.rotary,
                           pos[:, None, :] <= pos[:, :, None], record=kv, pick=layer_ids)
    return target.features(picked, layer_ids), kv


def target_verify(target: Target, kv: list, blocks: torch.Tensor, starts: torch.Tensor,
                  layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Verify features [b, N*B, K*H] of proposed blocks [b, N*B], each on top of its clean context."""
    B = blocks.shape[1] // starts.shape[1]
    pos = (starts[..., None] + torch.arange(B, device=blocks.device)).flatten(1)
    mask = block_mask(kv[0][0].shape[2], starts, B, causal=True)
    _, picked = run_layers(target.model.layers[:max(layer_ids) + 1], target.embed_tokens(blocks), pos,
                           target.rotary, mask, ctx_kv=kv, pick=layer_ids)
    return target.features(picked, layer_ids)


def drafter_context(drafter: Drafter, feats: torch.Tensor) -> list:
    """Per-layer context K/V, as `Drafter.write_context` caches them (shared by all blocks and rounds)."""
    ctx = drafter.project(feats)
    pos = torch.arange(feats.shape[1], device=feats.device).expand(feats.shape[:2])
    cos, sin = drafter.rotary(pos, ctx.dtype)
    return [layer.self_attn.key_value(ctx, cos, sin) for layer in drafter.layers]


def draft_hidden(drafter: Drafter, ctx_kv: list, emb: torch.Tensor, starts: torch.Tensor,
                 relay_kv: tuple | None = None) -> torch.Tensor:
    """`Drafter.forward` for N blocks per row at once: emb [b, N*B, H] -> normed hidden [b, N*B, H];
    `relay_kv` = (vectors [b, N*B, H], valid [b, N*B]) of a `kv` relay."""
    B = drafter.block_size
    pos = (starts[..., None] + torch.arange(B, device=emb.device)).flatten(1)
    mask = block_mask(ctx_kv[0][0].shape[2], starts, B, causal=False)
    extra = None
    if relay_kv is not None:
        vectors, seen = relay_kv[0], relay_mask(relay_kv[1], B)

        def extra(attn, cos, sin):
            return relay_keys(attn, vectors, seen, cos, sin)
    h, _ = run_layers(drafter.layers, emb, pos, drafter.rotary, mask, ctx_kv=ctx_kv, extra=extra)
    return drafter.norm(h)


def soft_cross_entropy(drafter: Drafter, logits: torch.Tensor, soft: tuple[torch.Tensor, torch.Tensor],
                       pos: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of slots 1.. (logits [b, N, B-1, V']) against the target's top-k distribution of the
    token at each slot's position (`soft` rows [b, L, k] hold the distribution of the token after each
    position), renormalised over the tokens the drafter's vocabulary holds; [b * N * (B-1)]."""
    ids, probs = soft
    b, N, B = pos.shape
    src = (pos[..., 1:] - 1).clamp(max=ids.shape[1] - 1).flatten(1)  # slot k's label comes from position p+k-1
    k = ids.shape[-1]
    cols = drafter.columns(ids.gather(1, src[..., None].expand(-1, -1, k)))
    p = probs.gather(1, src[..., None].expand(-1, -1, k)).float() * (cols >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    logq = logits.float().log_softmax(-1).view(b, N * (B - 1), -1).gather(-1, cols.clamp(min=0))
    return -(p * logq).sum(-1).flatten()


class DraftPass(nn.Module):
    """One draft pass of N blocks per row, with the relay (if any) as the drafter's config says. A module
    of its own so that `torch.func.functional_call` can rerun it with the shared weights detached."""

    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, ctx_kv: list, emb: torch.Tensor, starts: torch.Tensor, relay: VerifyRecord | None,
                target: Target) -> torch.Tensor:
        relay_kv = None
        if relay is not None:
            vectors, valid = self.drafter.relay_vectors(target, relay, None)
            vectors, valid = vectors.view_as(emb), valid.view(emb.shape[:2])
            if self.drafter.config.relay_input == "kv":
                relay_kv = vectors, valid
            else:
                emb = emb + vectors
        return draft_hidden(self.drafter, ctx_kv, emb, starts, relay_kv)


class DraftObjective(nn.Module):
    """Loss and statistics of one batch; `rounds` = 1 is DFlash, 3 is DFlow self-conditioning.

    Holds the drafter as its only parameters (the frozen target stays out of the state dict, the
    optimizer and DDP), so a DDP wrapper around it synchronises exactly the drafter's gradients.
    `base_first_round`: the shared (DFlash) weights learn from round 1 alone, which is the DFlash loss,
    and rounds 2.. train the relay alone, so the relay-off drafter gets DFlash updates (up to the anchor
    draws, which leave room for 3 rounds, and the gradient clip, whose norm includes the relay's).
    `distill` w: each slot's loss is (1 - w) x cross-entropy on the hard label + w x cross-entropy on the
    target's own top-k distribution there (renormalised over the tokens the drafter can draft).
    `oracle_relay`: for an experiment's bound, never for a drafter to deploy: the relay carries the
    target's states of the true continuation (which no inference round has) instead of the drafts'.
    """

    def __init__(self, drafter: Drafter, target: Target, gamma: float, rounds: int = 1,
                 base_first_round: bool = False, distill: float = 0.0, oracle_relay: bool = False):
        super().__init__()
        self.draft, self._frozen, self.rounds = DraftPass(drafter), (target,), rounds
        self.base_first_round, self.distill, self.oracle_relay = base_first_round, distill, oracle_relay
        k = torch.arange(drafter.block_size, dtype=torch.float32)
        self.register_buffer("weights", torch.where(k >= 1, torch.exp(-(k - 1) / gamma), 0.0), persistent=False)

    @property
    def drafter(self) -> Drafter:
        return self.draft.drafter

    def draft_pass(self, ctx_kv: list, emb: torch.Tensor, starts: torch.Tensor, relay: VerifyRecord | None,
                   relay_alone: bool) -> torch.Tensor:
        """Drafter hidden states; with `relay_alone`, gradients reach the relay's own weights only."""
        target = self._frozen[0]
        if not relay_alone:
            return self.draft(ctx_kv, emb, starts, relay, target)
        shared = {n: p.detach() for n, p in self.draft.named_parameters() if not n.startswith("drafter.relay.")}
        ctx_kv = [(k.detach(), v.detach()) for k, v in ctx_kv]
        return torch.func.functional_call(self.draft, shared, (ctx_kv, emb, starts, relay, target))

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, ok: torch.Tensor,
                trace: list | None = None, rounds: int | None = None,
                feats: torch.Tensor | None = None, truth: torch.Tensor | None = None,
                soft: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """ids [b, L] (padded), lengths [b], anchors starts/ok [b, N] -> (summed loss, stats sums).
        `feats`: the target's cached context features of `ids` [b, L, K*H]; a relay-less drafter then
        never runs the target (a relay needs the target's keys and values for its online verify).
        `truth` [b, L]: what the drafter learns at each position when it is not `ids` itself (labelled
        text: the target's own token there); blocks still start from the text's token at the anchor.
        `soft` (ids, probs) [b, L, k]: the target's top-k distribution of the token after each position.

        Unrolled from the prompt's end for many `rounds`, these are exactly the rounds `generate` runs
        on that sequence (a relay-less drafter skips the verify pass), so evaluation can measure tau."""
        d, t, B = self.drafter, self._frozen[0], self.drafter.block_size
        rounds, use_relay = rounds or self.rounds, d.relay is not None and d.use_relay
        (b, N), L, layer_ids = starts.shape, ids.shape[1], d.target_layer_ids
        if feats is None or use_relay:
            with torch.no_grad():
                feats, target_kv = target_context(t, ids, layer_ids)
        ctx_kv = drafter_context(d, feats)
        slots = torch.arange(B, device=ids.device)
        truth_ids = ids if truth is None else truth
        total, stats, relay = 0.0, {}, None
        for r in range(1, rounds + 1):
            pos = starts[..., None] + slots
            valid = (pos < lengths[:, None, None]) & ok[..., None]
            truth = truth_ids.gather(1, pos.clamp(max=L - 1).flatten(1)).view(b, N, B)
            block = torch.full_like(truth, d.config.mask_token_id)
            block[..., 0] = ids.gather(1, starts.clamp(max=L - 1))
            hidden = self.draft_pass(ctx_kv, d.embed(t, block.flatten(1)), starts, relay,
                                     self.base_first_round and r > 1)
            # Slots 1.. as one contiguous matrix: the head is a plain GEMM (2.4x faster on CPU than on the slice).
            logits = d.logits(t, hidden.view(b, N, B, -1)[:, :, 1:].reshape(b * N * (B - 1), -1)).view(b, N, B - 1, -1)
            # a drafter with a draft vocabulary learns to rank its own tokens (a token outside it is never drafted)
            cols = d.columns(truth[..., 1:])
            w = self.weights[1:] * valid[..., 1:] * (cols >= 0)
            ce = F.cross_entropy(logits.flatten(0, 2).float(), cols.clamp(min=0).flatten(), reduction="none")
            if soft is not None and self.distill:
                ce = (1 - self.distill) * ce + self.distill * soft_cross_entropy(d, logits, soft, pos)
            loss = (ce.view_as(w) * w).sum() / w.sum().clamp(min=1e-9)
            total = total + loss
            drafts = d.token_ids(logits.detach().argmax(-1))
            hit = (drafts == truth[..., 1:]) & valid[..., 1:]
            accepted = hit.long().cumprod(-1).sum(-1)  # a: leading drafts equal to the ground truth
            stats.update({f"loss{r}": loss.detach(), f"blocks{r}": ok.sum(), f"tau{r}": ((accepted + 1) * ok).sum(),
                          f"hits{r}": hit.sum((0, 1)), f"slots{r}": valid[..., 1:].sum((0, 1))})
            if trace is not None:
                trace.append({"starts": starts, "drafts": drafts, "accepted": accepted, "ok": ok})
            nxt_starts = starts + accepted + 1
            nxt_ok = ok & (nxt_starts + 1 < lengths[:, None])  # a next round with something left to draft
            if r == rounds or (rounds != self.rounds and not nxt_ok.any()):  # training: every rank, every round
                break
            if use_relay:
                relay = self.relay_inputs(truth_ids, target_kv, block, drafts, starts, accepted)
                if trace is not None:
                    trace[-1]["relay"] = relay
            starts, ok = nxt_starts, nxt_ok
        return total, stats

    @torch.no_grad()
    def relay_inputs(self, truth: torch.Tensor, target_kv: list, block: torch.Tensor, drafts: torch.Tensor,
                     starts: torch.Tensor, accepted: torch.Tensor) -> VerifyRecord:
        """Verify the drafts online and record the pass in a `VerifyRecord`, as the inference round does
        (`truth` [b, L]: the target's token at each position)."""
        d, t, (b, N, B) = self.drafter, self._frozen[0], block.shape
        verify = torch.cat([block[..., :1], drafts], dim=-1)
        states_of = verify
        if self.oracle_relay:  # the true tokens x_p.. of the block: their states, the drafts' ids
            at = (starts[..., None] + torch.arange(B, device=truth.device)).clamp(max=truth.shape[1] - 1)
            states_of = torch.cat([block[..., :1], truth.gather(1, at.flatten(1)).view(b, N, B)[..., 1:]], dim=-1)
        vfeat = target_verify(t, target_kv, states_of.flatten(1), starts, d.target_layer_ids)
        # The verifier's argmax at each block position is the ground truth's next token (the data is
        # the target's greedy output), so VerifyRecord.write takes c = x_{p'} and d = the first rejected draft.
        pos = (starts[..., None] + torch.arange(1, B + 1, device=truth.device)).clamp(max=truth.shape[1] - 1)
        relay = d.new_verify_record(b * N, B)
        relay.write(None, vfeat.view(b * N, B, -1), verify.view(b * N, B),
                    truth.gather(1, pos.flatten(1)).view(b * N, B), accepted.flatten())
        return relay
