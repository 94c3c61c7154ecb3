"""DFlash and DFlow drafter training on target-regenerated sequences (DESIGN §1).

DFlash: random anchors p per sequence; block `[x_p, MASK x (B-1)]` at positions p..p+B-1 sees the
frozen target's features of positions STRICTLY before p (the anchor's feature does not exist yet at
inference), itself bidirectionally and no other block; slot k predicts x_{p+k} (same position), slot 0
is unsupervised; CE weighted exp(-(k-1)/gamma). A sequence's anchor blocks share one context
projection and attend under one [N*B, ctx + N*B] mask: one target pass and one drafter pass a batch.

DFlow: that round unrolled 3 times per anchor with shared weights. Each round's greedy drafts are
verified ONLINE by the frozen target (the proposed block on top of the clean context, no_grad);
acceptance and the next anchor come from matching drafts against the ground truth; the next round's
mask slots get relays built by the inference code itself (`RelayBuffer.write`,
`Drafter.relay_embeddings`), so slot mapping and c/d cannot drift from the runtime. Drafts are
argmax: no gradient crosses rounds. Round losses are summed; with `base_first_round` the shared
weights learn from round 1 (the DFlash loss) and the relay alone from the later rounds.

The batched forwards below reuse the models' modules (`key_value`/`query`/`output`); tests check
them against the inference forwards.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflow_rt.errors import InputError
from dflow_rt.models.checkpoint import load_drafter, load_target, save_model
from dflow_rt.models.drafter import Drafter, DrafterConfig, build_target_layer_ids, with_relay
from dflow_rt.models.layers import Rotary
from dflow_rt.models.relay import RelayBuffer
from dflow_rt.models.target import Target
from dflow_rt.tokenizer import load_tokenizer, stop_token_ids
from dflow_rt.train import loop
from dflow_rt.train.regen import (
    AnchorBatches,
    collate,
    file_digest,
    heldout_prompts,
    heldout_tau,
    load_sequences,
    model_digest,
)

# Settings that define a run (a resumed run keeps its own). `batch` is per rank, like the target's.
DFLASH_DEFAULTS = {"block_size": 16, "layers": 2, "target_layers": None, "mask_token_id": None, "anchors": 32,
                   "lr": 1e-3, "gamma": "auto", "warmup": 50, "min_lr_ratio": 0.1, "weight_decay": 0.01, "clip": 1.0,
                   "seed": 0, "steps": None, "minutes": None, "eval_seqs": 16, "init": None}
DFLOW_DEFAULTS = {**DFLASH_DEFAULTS, "relay_hidden": None, "relay_lr_scale": 1.0, "base_lr_scale": 1.0, "rounds": 3,
                  "base_first_round": False}


def auto_gamma(block_size: int) -> float:
    """Loss decay: 7 at B = 16 (the public recipe), 4 at B = 8 (DESIGN §7), linear in between."""
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
               ctx_kv: list | None = None, record: list | None = None, pick: tuple[int, ...] = ()):
    """Decoder layers over `h` whose keys are [ctx_kv[i] ; own]; returns (h, {layer: output} of `pick`)."""
    cos, sin = rotary(pos, h.dtype)
    picked = {}
    for i, layer in enumerate(layers):
        def attend(attn, x, i=i):
            k, v = attn.key_value(x, cos, sin)
            if record is not None:
                record.append((k, v))
            if ctx_kv is not None:
                k, v = torch.cat([ctx_kv[i][0], k], dim=2), torch.cat([ctx_kv[i][1], v], dim=2)
            return attn.output(attn.query(x, cos, sin), k, v, mask)

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
    return torch.cat([picked[i] for i in layer_ids], dim=-1), kv


def target_verify(target: Target, kv: list, blocks: torch.Tensor, starts: torch.Tensor,
                  layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Verify features [b, N*B, K*H] of proposed blocks [b, N*B], each on top of its clean context."""
    B = blocks.shape[1] // starts.shape[1]
    pos = (starts[..., None] + torch.arange(B, device=blocks.device)).flatten(1)
    mask = block_mask(kv[0][0].shape[2], starts, B, causal=True)
    _, picked = run_layers(target.model.layers[:max(layer_ids) + 1], target.embed_tokens(blocks), pos,
                           target.rotary, mask, ctx_kv=kv, pick=layer_ids)
    return torch.cat([picked[i] for i in layer_ids], dim=-1)


def drafter_context(drafter: Drafter, feats: torch.Tensor) -> list:
    """Per-layer context K/V, as `Drafter.write_context` caches them (shared by all blocks and rounds)."""
    ctx = drafter.hidden_norm(drafter.fc(feats))
    pos = torch.arange(feats.shape[1], device=feats.device).expand(feats.shape[:2])
    cos, sin = drafter.rotary(pos, ctx.dtype)
    return [layer.self_attn.key_value(ctx, cos, sin) for layer in drafter.layers]


def draft_hidden(drafter: Drafter, ctx_kv: list, emb: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """`Drafter.forward` for N blocks per row at once: emb [b, N*B, H] -> normed hidden [b, N*B, H]."""
    B = drafter.block_size
    pos = (starts[..., None] + torch.arange(B, device=emb.device)).flatten(1)
    mask = block_mask(ctx_kv[0][0].shape[2], starts, B, causal=False)
    h, _ = run_layers(drafter.layers, emb, pos, drafter.rotary, mask, ctx_kv=ctx_kv)
    return drafter.norm(h)


class DraftPass(nn.Module):
    """One draft pass of N blocks per row, the relay (if any) added to the block embeddings. A module of
    its own so that `torch.func.functional_call` can rerun it with the shared weights detached."""

    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, ctx_kv: list, emb: torch.Tensor, starts: torch.Tensor, relay: RelayBuffer | None,
                embed: nn.Embedding) -> torch.Tensor:
        if relay is not None:
            emb = emb + self.drafter.relay_embeddings(embed, relay, None).view_as(emb)
        return draft_hidden(self.drafter, ctx_kv, emb, starts)


class DraftObjective(nn.Module):
    """Loss and statistics of one batch; `rounds` = 1 is DFlash, 3 is DFlow self-conditioning.

    Holds the drafter as its only parameters (the frozen target stays out of the state dict, the
    optimizer and DDP), so a DDP wrapper around it synchronises exactly the drafter's gradients.
    `base_first_round`: the shared (DFlash) weights learn from round 1 alone, which is the DFlash loss,
    and rounds 2.. train the relay alone, so the relay-off drafter trains as a DFlash drafter would.
    """

    def __init__(self, drafter: Drafter, target: Target, gamma: float, rounds: int = 1,
                 base_first_round: bool = False):
        super().__init__()
        self.draft, self._frozen, self.rounds = DraftPass(drafter), (target,), rounds
        self.base_first_round = base_first_round
        k = torch.arange(drafter.block_size, dtype=torch.float32)
        self.register_buffer("weights", torch.where(k >= 1, torch.exp(-(k - 1) / gamma), 0.0), persistent=False)

    @property
    def drafter(self) -> Drafter:
        return self.draft.drafter

    def draft_pass(self, ctx_kv: list, emb: torch.Tensor, starts: torch.Tensor, relay: RelayBuffer | None,
                   relay_alone: bool) -> torch.Tensor:
        """Drafter hidden states; with `relay_alone`, gradients reach the relay's own weights only."""
        embed = self._frozen[0].embed_tokens
        if not relay_alone:
            return self.draft(ctx_kv, emb, starts, relay, embed)
        shared = {n: p.detach() for n, p in self.draft.named_parameters() if not n.startswith("drafter.relay.")}
        ctx_kv = [(k.detach(), v.detach()) for k, v in ctx_kv]
        return torch.func.functional_call(self.draft, shared, (ctx_kv, emb, starts, relay, embed))

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, ok: torch.Tensor,
                trace: list | None = None, rounds: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """ids [b, L] (padded), lengths [b], anchors starts/ok [b, N] -> (summed loss, stats sums).

        Unrolled from the prompt's end for many `rounds`, these are exactly the rounds `generate` runs
        on that sequence (a relay-less drafter skips the verify pass), so evaluation can measure tau."""
        d, t, B = self.drafter, self._frozen[0], self.drafter.block_size
        rounds, use_relay = rounds or self.rounds, d.relay is not None and d.use_relay
        (b, N), L, layer_ids = starts.shape, ids.shape[1], d.target_layer_ids
        with torch.no_grad():
            feats, target_kv = target_context(t, ids, layer_ids)
        ctx_kv = drafter_context(d, feats)
        slots = torch.arange(B, device=ids.device)
        total, stats, relay = 0.0, {}, None
        for r in range(1, rounds + 1):
            pos = starts[..., None] + slots
            valid = (pos < lengths[:, None, None]) & ok[..., None]
            truth = ids.gather(1, pos.clamp(max=L - 1).flatten(1)).view(b, N, B)
            block = torch.full_like(truth, d.config.mask_token_id)
            block[..., 0] = truth[..., 0]
            hidden = self.draft_pass(ctx_kv, t.embed_tokens(block.flatten(1)), starts, relay,
                                     self.base_first_round and r > 1)
            logits = t.lm_head(hidden.view(b, N, B, -1)[:, :, 1:])
            w = self.weights[1:] * valid[..., 1:]
            ce = F.cross_entropy(logits.flatten(0, 2).float(), truth[..., 1:].flatten(), reduction="none")
            loss = (ce.view_as(w) * w).sum() / w.sum().clamp(min=1e-9)
            total = total + loss
            drafts = logits.detach().argmax(-1)
            hit = (drafts == truth[..., 1:]) & valid[..., 1:]
            accepted = hit.long().cumprod(-1).sum(-1)  # a: leading drafts equal to the ground truth
            stats.update({f"loss{r}": loss.detach(), f"blocks{r}": ok.sum(), f"tau{r}": ((accepted + 1) * ok).sum(),
                          f"hits{r}": hit.sum((0, 1)), f"slots{r}": valid[..., 1:].sum((0, 1))})
            if trace is not None:
                trace.append({"starts": starts, "drafts": drafts, "accepted": accepted})
            nxt_starts = starts + accepted + 1
            nxt_ok = ok & (nxt_starts + 1 < lengths[:, None])  # a next round with something left to draft
            if r == rounds or (rounds != self.rounds and not nxt_ok.any()):  # training: every rank, every round
                break
            if use_relay:
                relay = self.relay_inputs(ids, target_kv, block, drafts, starts, accepted)
                if trace is not None:
                    trace[-1]["relay"] = relay
            starts, ok = nxt_starts, nxt_ok
        return total, stats

    @torch.no_grad()
    def relay_inputs(self, ids: torch.Tensor, target_kv: list, block: torch.Tensor, drafts: torch.Tensor,
                     starts: torch.Tensor, accepted: torch.Tensor) -> RelayBuffer:
        """Verify the drafts online and record the pass in a `RelayBuffer`, as the inference round does."""
        d, t, (b, N, B) = self.drafter, self._frozen[0], block.shape
        verify = torch.cat([block[..., :1], drafts], dim=-1)
        vfeat = target_verify(t, target_kv, verify.flatten(1), starts, d.target_layer_ids)
        # The verifier's argmax at each block position is the ground truth's next token (the data is
        # the target's greedy output), so RelayBuffer.write takes c = x_{p'} and d = the first rejected draft.
        pos = (starts[..., None] + torch.arange(1, B + 1, device=ids.device)).clamp(max=ids.shape[1] - 1)
        relay = d.new_relay_buffer(b * N, B)
        relay.write(None, vfeat.view(b * N, B, -1), verify.view(b * N, B), ids.gather(1, pos.flatten(1)).view(b * N, B),
                    accepted.flatten())
        return relay


# ------------------------------------------------------------------------------------- training

class ScaledAdamW(torch.optim.AdamW):
    """AdamW whose groups may carry an `lr_scale` (the relay's): the shared loop sets one lr on all groups."""

    def step(self, closure=None):
        base = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] *= g.get("lr_scale", 1.0)
        try:
            return super().step(closure)
        finally:
            for g, lr in zip(self.param_groups, base, strict=True):
                g["lr"] = lr


def make_optimizer(drafter: Drafter, lr: float, weight_decay: float, relay_lr_scale: float = 1.0,
                   base_lr_scale: float = 1.0) -> ScaledAdamW:
    """Matrices decay, gains do not; relay and DFlash (base) parameters get their own learning-rate scales
    (base 0 trains the relay alone: the DFlash weights, and so the relay-off drafts, stay exactly as they were)."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in drafter.named_parameters():
        groups.setdefault((name.startswith("relay."), p.dim() >= 2), []).append(p)
    return ScaledAdamW([{"params": ps, "weight_decay": weight_decay if decay else 0.0,
                         "lr_scale": relay_lr_scale if relay else base_lr_scale}
                        for (relay, decay), ps in groups.items()], lr=lr, betas=(0.9, 0.95), eps=1e-8)


class DrafterTask:
    """The shared loop's `Task`, plus JSON records: "draft" (loss and tau per round, per-slot accuracy, ETA)
    every `log_every` steps and "eval_slots" at each evaluation."""

    def __init__(self, objective: DraftObjective, forward: nn.Module, batches: AnchorBatches, eval_rows: list[int],
                 d: loop.Dist, out: Path, log_every: int, budget: dict, prompts: list, stop_ids: list[int],
                 eval_tokens: int, device: torch.device | str = "cpu"):
        self.objective, self.forward, self.batches, self.eval_rows, self.d = objective, forward, batches, eval_rows, d
        self.device = device
        self.log, self.log_every, self.budget = loop.JsonLog(out / loop.LOG, d), log_every, budget
        self.prompts, self.stop_ids, self.eval_tokens = prompts, stop_ids, eval_tokens
        self.window, self.t0, self.elapsed0, self.window_t = {}, time.perf_counter(), 0.0, time.perf_counter()

    def loss(self, step: int) -> tuple[torch.Tensor, int]:
        """One batch; `tokens` (for tokens/s) counts supervised draft slots over all rounds."""
        loss, stats = self.forward(*(t.to(self.device) for t in self.batches.next()))
        for k, v in stats.items():
            self.window[k] = self.window.get(k, 0) + v.detach().double()
        if (step + 1) % self.log_every == 0:
            keys = sorted(self.window)  # means over ranks of every sum (one all-reduce): ratios are unchanged
            flat = iter(loop.all_mean(torch.cat([self.window[k].flatten() for k in keys]).tolist(), self.d))
            w = {k: torch.tensor([next(flat) for _ in range(self.window[k].numel())]) for k in keys}
            now = time.perf_counter()
            per_step = (now - self.window_t) / self.log_every
            left = ((self.budget["steps"] - step - 1) * per_step if self.budget["steps"] else
                    self.budget["minutes"] * 60 - (self.elapsed0 + now - self.t0))
            rounds = range(1, self.objective.rounds + 1)
            self.log.write("draft", step=step + 1, **{f"loss{r}": round(float(w[f"loss{r}"]) / self.log_every, 4)
                                                      for r in rounds},
                           **{f"tau{r}": round(float(w[f"tau{r}"] / w[f"blocks{r}"].clamp(min=1)), 4) for r in rounds},
                           slot_acc=[round(a, 4) for a in (w["hits1"] / w["slots1"].clamp(min=1)).tolist()],
                           s_per_step=round(per_step, 3), eta_s=round(max(left, 0.0), 1))
            self.window, self.window_t = {}, now
        return loss, int(sum(v.sum() for k, v in stats.items() if k.startswith("slots")))

    @torch.no_grad()
    def rollout(self, max_rounds: int = 1024) -> dict[str, torch.Tensor]:
        """Rounds unrolled from each held-out sequence's prompt to its end: exactly the rounds `generate`
        runs on it (the continuation is the target's greedy one), so their mean acceptance is real tau."""
        b, sums = self.batches, {}
        for k in range(0, len(self.eval_rows), b.per_rank):
            rows = self.eval_rows[k:k + b.per_rank]
            ids, lengths, _, _ = collate(b.seqs, rows, 1, b.block, b.block, [""] * len(rows))
            ids, lengths = ids.to(self.device), lengths.to(self.device)
            starts = b.seqs.prompt_lens[rows].long()[:, None].to(self.device)
            _, stats = self.objective(ids, lengths, starts, torch.ones_like(starts, dtype=torch.bool), None, max_rounds)
            for name, v in stats.items():
                key = name.rstrip("0123456789")
                sums[key] = sums.get(key, 0) + (v * stats[name.replace("loss", "blocks")] if key == "loss" else v)
        return sums

    def evaluate(self) -> dict[str, float]:
        """Held-out sequences: real-round tau (DFlow: also with the relay off), loss and slot accuracy of
        those rounds; real tau of `generate` on prompts of the held-out suites."""
        drafter, out = self.objective.drafter, {}
        for suffix, relay in [("", True), ("_norelay", False)][:2 if drafter.relay is not None else 1]:
            drafter.use_relay = relay and drafter.relay is not None
            sums = self.rollout() if self.eval_rows else {}
            if sums:
                out[f"eval_tau{suffix}"] = float(sums["tau"] / sums["blocks"])
            if sums and not suffix:
                acc = (sums["hits"] / sums["slots"].clamp(min=1)).tolist()
                out |= {"eval_loss": float(sums["loss"] / sums["blocks"]), "eval_acc1": acc[0],
                        f"eval_acc{len(acc)}": acc[-1]}
                self.log.write("eval_slots", slot_acc=[round(a, 4) for a in acc])
        drafter.use_relay = drafter.relay is not None
        if self.prompts:
            out |= heldout_tau(self.objective._frozen[0], drafter, self.prompts, self.eval_tokens, self.stop_ids)
        self.window_t = time.perf_counter()
        return out

    def state(self) -> dict:
        return {**self.batches.state(), "elapsed": self.elapsed0 + time.perf_counter() - self.t0}

    def load_state(self, state: dict) -> None:
        self.batches.load_state(state)
        self.elapsed0 = float(state.get("elapsed", 0.0))

    def export(self, directory: Path) -> None:
        save_model(self.objective.drafter, directory)


def resolve_settings(kind: str, given: dict, out: Path, resume: bool) -> tuple[dict, dict | None]:
    """Defaults + CLI for a new run; the checkpoint's for a resumed one (a conflicting value is an error)."""
    defaults = DFLASH_DEFAULTS if kind == "dflash" else DFLOW_DEFAULTS
    unknown = set(given) - set(defaults)
    if unknown:
        raise InputError(f"{kind} does not take: {', '.join(sorted(unknown))}")
    state = loop.read_state(out)
    if not resume:
        if state is not None:
            raise InputError(f"{out}/{loop.CHECKPOINT} exists: pass --resume to continue it, or choose another --out")
        settings = {k: (given.get(k) if given.get(k) is not None else v) for k, v in defaults.items()}
        if (settings["steps"] is None) == (settings["minutes"] is None):
            raise InputError("give exactly one of --steps and --minutes")
        return settings, None
    if state is None or state["run"].get("kind") != kind:
        raise InputError(f"--resume: no {kind} checkpoint in {out}" + (f" (it holds a {state['run'].get('kind')} "
                                                                        "run)" if state else ""))
    settings = {**defaults, **state["run"]["settings"]}  # settings added since the run started keep their default
    clash = [f"--{k.replace('_', '-')} {v} (checkpoint: {settings[k]})" for k, v in given.items()
             if v is not None and v != settings[k]]
    if clash:
        raise InputError("--resume keeps the checkpoint's settings; conflicting: " + ", ".join(clash))
    return settings, state


def build_drafter(kind: str, target: Target, target_dir: Path, s: dict) -> Drafter:
    """A fresh drafter shaped by the target, or the --init drafter (DFlow: a DFlash one converted with a
    zero-init relay)."""
    t = target.config
    if s["init"]:
        parent = load_drafter(s["init"], target)
        if kind == "dflash":
            if parent.relay is not None:
                raise InputError(f"--init {s['init']}: a DFlow drafter; `train dflash` continues DFlash drafters")
            return parent
        return parent if parent.relay is not None else with_relay(parent, s["relay_hidden"] or t.hidden_size, s["seed"])
    mask = s["mask_token_id"]
    if mask is None and (target_dir / "tokenizer.json").exists():
        mask = load_tokenizer(target_dir).mask_token_id
    layer_ids = s["target_layers"] or build_target_layer_ids(t.num_hidden_layers, s["layers"])
    config = DrafterConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=s["layers"],
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
        vocab_size=t.vocab_size, block_size=s["block_size"], mask_token_id=t.vocab_size - 1 if mask is None else mask,
        target_layer_ids=tuple(layer_ids), num_target_layers=t.num_hidden_layers, rope_theta=t.rope_theta,
        rope_scaling=t.rope_scaling, rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
        relay_hidden=(s["relay_hidden"] or t.hidden_size) if kind == "dflow" else 0)
    torch.manual_seed(s["seed"])
    drafter = Drafter(config)
    for p in drafter.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    if drafter.relay is not None:
        drafter.relay.zero_init()
    return drafter


def train_drafter(kind: str, target_dir: str | Path, data: str | Path, out: str | Path, batch: int = 4,
                  resume: bool = False, threads: int | None = None, checkpoint_every: int = 500, log_every: int = 10,
                  run_steps: int | None = None, eval_prompts: int = 8, eval_max_new_tokens: int = 64,
                  device: str = "cpu", **given) -> dict:
    """Train (or resume) a `kind` ("dflash" or "dflow") drafter into `out`; `batch` is per rank.
    `given` holds DFLASH/DFLOW_DEFAULTS keys (None = not given). Returns the loop's final state."""
    out, target_dir = Path(out), Path(target_dir)
    d = loop.init_distributed(device)
    dev = loop.local_device(device)
    threads = threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", d.world)))
    torch.set_num_threads(threads)
    settings, state = resolve_settings(kind, given, out, resume)
    target = load_target(target_dir, device=dev).requires_grad_(False)
    digests = {"target_digest": model_digest(target_dir), "data_digest": file_digest(data)}
    if state and any(state["run"][k] != v for k, v in digests.items()):
        raise InputError("--resume needs the same --target and --data as the checkpoint's run")
    seqs = load_sequences(data)
    if int(seqs.tokens.max()) >= target.config.vocab_size:
        raise InputError(f"{data}: token ids beyond the target's vocabulary of {target.config.vocab_size}")
    drafter = (load_drafter(Path(state["_dir"]) / "model", target) if state else
               build_drafter(kind, target, target_dir, settings)).to(dev).train()
    B, s, layer_ids = drafter.block_size, settings, drafter.target_layer_ids
    gamma = auto_gamma(B) if s["gamma"] == "auto" else float(s["gamma"])
    objective = DraftObjective(drafter, target, gamma, rounds=s["rounds"] if kind == "dflow" else 1,
                               base_first_round=s.get("base_first_round", False)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel
    forward = (ddp(objective, broadcast_buffers=False, device_ids=[dev] if dev.type == "cuda" else None)
               if d.world > 1 else objective)
    global_batch = state["run"]["global_batch"] if state else batch * d.world
    n_train = len(seqs) - s["eval_seqs"]
    batches = AnchorBatches(seqs, list(range(n_train)), global_batch, s["anchors"], B, objective.rounds, s["seed"],
                            d.rank, d.world)
    tokenizer = load_tokenizer(target_dir) if (target_dir / "tokenizer.json").exists() else None
    prompts = heldout_prompts(tokenizer, eval_prompts) if tokenizer and d.main else []
    stops = stop_token_ids(tokenizer) if tokenizer else []
    task = DrafterTask(objective, forward, batches, list(range(n_train, len(seqs))), d, out, log_every,
                       {"steps": s["steps"], "minutes": s["minutes"]}, prompts, stops, eval_max_new_tokens, dev)
    cfg = loop.LoopConfig(out=out, lr=s["lr"], total_steps=s["steps"], minutes=s["minutes"], warmup=s["warmup"],
                          min_lr_ratio=s["min_lr_ratio"], clip=s["clip"], checkpoint_every=checkpoint_every,
                          log_every=log_every, run_steps=run_steps)
    info = {"kind": kind, "settings": settings, "global_batch": global_batch, "target": str(target_dir),
            "data": str(data), **digests, "gamma": gamma, "block_size": B, "target_layer_ids": list(layer_ids),
            "mask_token_id": drafter.config.mask_token_id, "params": sum(p.numel() for p in drafter.parameters())}
    out.mkdir(parents=True, exist_ok=True)
    if d.main and not state:
        print(f"{kind}: {json.dumps({k: info[k] for k in ('params', 'block_size', 'target_layer_ids', 'gamma')})}, "
              f"{len(seqs)} sequences, {d.world} rank(s) x {threads} thread(s)", flush=True)
    optimizer = make_optimizer(drafter, s["lr"], s["weight_decay"], s.get("relay_lr_scale", 1.0),
                               s.get("base_lr_scale", 1.0))
    result = loop.run(cfg, drafter, optimizer, task, d, info, state)
    if d.world > 1:
        torch.distributed.destroy_process_group()
    return result
