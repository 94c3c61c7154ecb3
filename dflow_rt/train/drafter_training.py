"""Drafter training runs (`dflow-rt train dflash|dflow`): settings, optimizer, the loop's task, export.

The objective itself (DFlash loss, DFlow self-conditioning rounds) is in `dflow_rt.train.objective`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from dflow_rt.data.prompts import heldout_prompts
from dflow_rt.errors import InputError
from dflow_rt.eval.tau import heldout_tau
from dflow_rt.models.checkpoint import load_drafter, load_target, save_model
from dflow_rt.models.draft_vocab import build_draft_vocab
from dflow_rt.models.drafter import Drafter, DrafterConfig, build_target_layer_ids, relay_off, with_relay
from dflow_rt.models.target import Target
from dflow_rt.tokenizer import load_tokenizer, stop_token_ids
from dflow_rt.train import loop
from dflow_rt.train.anchors import AnchorBatches, collate, pad_truth
from dflow_rt.train.features import load_features, load_soft_labels
from dflow_rt.train.objective import DraftObjective, auto_gamma
from dflow_rt.train.sequences import file_digest, load_sequences, model_digest

# Settings that define a run (a resumed run keeps its own). `batch` is per rank, like the target's.
DFLASH_DEFAULTS = {"block_size": 16, "layers": 2, "target_layers": None, "mask_token_id": None, "anchors": 32,
                   "lr": 1e-3, "gamma": "auto", "warmup": 50, "min_lr_ratio": 0.1, "weight_decay": 0.01, "clip": 1.0,
                   "seed": 0, "steps": None, "minutes": None, "eval_seqs": 16, "init": None,
                   "target_dtype": "float32", "draft_vocab": 0, "sequences": None, "amp": "float32",
                   "init_layers": None, "distill": 0.0}
DFLOW_DEFAULTS = {**DFLASH_DEFAULTS, "relay_hidden": None, "relay_input": "mask_embedding", "relay_lr_scale": 1.0,
                  "base_lr_scale": 1.0, "rounds": 3, "base_first_round": False, "freeze_base": False,
                  "oracle_relay": False}


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
                   base_lr_scale: float = 1.0, clip_relay_apart: bool = False) -> ScaledAdamW:
    """Matrices decay, gains do not; relay and DFlash (base) parameters get their own learning-rate scales
    (base 0 trains the relay alone: the DFlash weights, and so the relay-off drafts, stay exactly as they were).
    `clip_relay_apart` clips the relay's gradient norm apart from the base's (`loop.clip_gradients`)."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in drafter.named_parameters():
        groups.setdefault((name.startswith("relay."), p.dim() >= 2), []).append(p)
    return ScaledAdamW([{"params": ps, "weight_decay": weight_decay if decay else 0.0,
                         "lr_scale": relay_lr_scale if relay else base_lr_scale,
                         "clip_apart": relay and clip_relay_apart}
                        for (relay, decay), ps in groups.items()], lr=lr, betas=(0.9, 0.95), eps=1e-8)


def freeze_shared_weights(drafter: Drafter) -> None:
    """The relay alone trains, and autograd skips what lr 0 would discard: the shared weights' gradients
    and round 1's whole backward pass (about a fifth of a relay-alone update)."""
    for name, p in drafter.named_parameters():
        p.requires_grad_(name.startswith("relay."))


@dataclass
class HeldOut:
    """What a drafter run evaluates at checkpoints: the rounds unrolled on its held-out sequences
    (`rows` of the data), and real tau of `generate` on held-out suite `prompts`."""

    rows: list[int]
    prompts: list[list[int]]
    stop_ids: list[int]
    max_new_tokens: int


class DrafterTask:
    """The shared loop's `Task`, plus JSON records: "draft" (loss and tau per round, per-slot accuracy, ETA)
    every `log_every` steps and "eval_slots" at each evaluation."""

    def __init__(self, objective: DraftObjective, forward: nn.Module, batches: AnchorBatches, d: loop.Dist,
                 out: Path, run: loop.RunOptions, s: dict, held_out: HeldOut):
        self.objective, self.forward, self.batches, self.d, self.held_out = objective, forward, batches, d, held_out
        self.device, self.amp = loop.local_device(run.device), getattr(torch, s["amp"])
        self.log, self.log_every = loop.JsonLog(out / loop.LOG, d), run.log_every
        self.budget = {"steps": s["steps"], "minutes": s["minutes"]}
        self.window, self.t0, self.elapsed0, self.window_t = {}, time.perf_counter(), 0.0, time.perf_counter()

    def loss(self, step: int) -> tuple[torch.Tensor, int]:
        """One batch; `tokens` (for tokens/s) counts supervised draft slots over all rounds."""
        b = {k: t.to(self.device) for k, t in self.batches.next().items()}
        with torch.autocast(torch.device(self.device).type, self.amp, enabled=self.amp != torch.float32):
            soft = (b["soft_ids"].long(), b["soft_probs"]) if "soft_ids" in b else None
            loss, stats = self.forward(b["ids"], b["lengths"], b["starts"], b["ok"], feats=b.get("feats"),
                                       truth=b.get("truth"), soft=soft)
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
        for k in range(0, len(self.held_out.rows), b.per_rank):
            rows = self.held_out.rows[k:k + b.per_rank]
            ids, lengths, _, _ = collate(b.seqs, rows, 1, b.block, b.block, [""] * len(rows))
            truth = pad_truth(b.seqs, rows, ids.shape[1]).to(self.device) if b.seqs.truth is not None else None
            ids, lengths = ids.to(self.device), lengths.to(self.device)
            starts = b.seqs.prompt_lens[rows].long()[:, None].to(self.device)
            _, stats = self.objective(ids, lengths, starts, torch.ones_like(starts, dtype=torch.bool), None, max_rounds,
                                      truth=truth)
            for name, v in stats.items():
                key = name.rstrip("0123456789")
                sums[key] = sums.get(key, 0) + (v * stats[name.replace("loss", "blocks")] if key == "loss" else v)
        return sums

    def evaluate(self) -> dict[str, float]:
        """Held-out sequences: real-round tau (DFlow: also with the relay off), loss and slot accuracy of
        those rounds; real tau of `generate` on prompts of the held-out suites."""
        drafter, out = self.objective.drafter, {}
        for suffix, off in [("", False), ("_norelay", True)][:2 if drafter.relay is not None else 1]:
            with relay_off(drafter, off):
                sums = self.rollout() if self.held_out.rows else {}
            if sums:
                out[f"eval_tau{suffix}"] = float(sums["tau"] / sums["blocks"])
            if sums and not suffix:
                acc = (sums["hits"] / sums["slots"].clamp(min=1)).tolist()
                out |= {"eval_loss": float(sums["loss"] / sums["blocks"]), "eval_acc1": acc[0],
                        f"eval_acc{len(acc)}": acc[-1]}
                self.log.write("eval_slots", slot_acc=[round(a, 4) for a in acc])
        h = self.held_out
        if h.prompts:
            out |= heldout_tau(self.objective._frozen[0], drafter, h.prompts, h.max_new_tokens, h.stop_ids)
        self.window_t = time.perf_counter()
        return out

    def state(self) -> dict:
        return {**self.batches.state(), "elapsed": self.elapsed0 + time.perf_counter() - self.t0}

    def load_state(self, state: dict) -> None:
        self.batches.load_state(state)
        self.elapsed0 = float(state.get("elapsed", 0.0))

    def export(self, directory: Path) -> None:
        save_model(self.objective.drafter, directory)


def build_drafter(kind: str, target: Target, target_dir: Path, s: dict, given: dict | None = None) -> Drafter:
    """A fresh drafter shaped by the target, or the --init drafter (DFlow: a DFlash one converted with a
    zero-init relay). `given` (the settings passed explicitly) must not contradict the --init drafter's shape."""
    t = target.config
    if s["init"] and s["init_layers"]:
        raise InputError("--init-layers starts a new drafter; --init continues one: give one of them")
    if s["init"]:
        # its draft vocabulary (if any) is a property of its training data: `train draft-vocab` remakes it
        parent = load_drafter(s["init"], target, dtype=torch.float32, draft_vocab=False)
        check_init_shape(s["init"], parent, given or {})
        block = (given or {}).get("block_size")
        if block is not None and block != parent.block_size:
            parent = reblocked(parent, block)
        if kind == "dflash":
            if parent.relay is not None:
                raise InputError(f"--init {s['init']}: a DFlow drafter; `train dflash` continues DFlash drafters")
            return parent
        if parent.relay is not None:
            return parent
        return with_relay(parent, s["relay_hidden"] or t.hidden_size, s["seed"], s["relay_input"])
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
        relay_hidden=(s["relay_hidden"] or t.hidden_size) if kind == "dflow" else 0,
        relay_input=s.get("relay_input", "mask_embedding"))
    torch.manual_seed(s["seed"])
    drafter = Drafter(config)
    for p in drafter.parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    if s["init_layers"]:
        copy_target_layers(drafter, target, s["init_layers"])
    if drafter.relay is not None:
        drafter.relay.zero_init()
    return drafter


def copy_target_layers(drafter: Drafter, target: Target, layer_ids: list[int]) -> None:
    """Start the drafter's decoder layers (and final norm) as copies of the target's layers `layer_ids`:
    they already turn the target's hidden states into next-token states. A drafter layer's q/k norms,
    which a target without them (Llama) lacks, stay at one (the identity scale)."""
    layers, n = target.model.layers, target.config.num_hidden_layers
    if len(layer_ids) != len(drafter.layers) or any(not 0 <= i < n for i in layer_ids):
        raise InputError(f"--init-layers {','.join(map(str, layer_ids))}: give {len(drafter.layers)} layer ids of "
                         f"the target's 0..{n - 1}, one per drafter layer")
    with torch.no_grad():
        for mine, i in zip(drafter.layers, layer_ids, strict=True):
            missing, unexpected = mine.load_state_dict(layers[i].state_dict(), strict=False)
            if unexpected or any(not k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing):
                raise InputError(f"--init-layers: target layer {i} does not have the drafter layer's shape")
        drafter.norm.load_state_dict(target.model.norm.state_dict())


def reblocked(drafter: Drafter, block_size: int) -> Drafter:
    """`drafter`'s weights as a drafter of another block size. No weight depends on B (positions enter
    through rotary, relative), so a drafter of 8 can be fine-tuned into one of the 4 positions a CPU
    Runtime verifies, which then no longer leans on masked slots it never sees (docs/experiments.md,
    "B fine-tuned as a block-4 drafter")."""
    out = Drafter(replace(drafter.config, block_size=block_size))
    out.load_state_dict(drafter.state_dict())
    w = drafter.fc.weight
    return out.to(device=w.device, dtype=w.dtype)


def check_init_shape(init: str, parent: Drafter, given: dict) -> None:
    """--init fixes the drafter's shape: a shape setting given explicitly must agree with it (a DFlash
    parent has no relay yet, so its relay settings are still free), or the run would silently ignore it.
    The block size is not part of the shape (`reblocked`)."""
    c = parent.config
    shape = {"layers": c.num_hidden_layers, "target_layers": list(c.target_layer_ids),
             "mask_token_id": c.mask_token_id}
    if parent.relay is not None:
        shape |= {"relay_hidden": c.relay_hidden, "relay_input": c.relay_input}
    clash = [f"--{k.replace('_', '-')} {given[k]} ({init}: {v})" for k, v in shape.items()
             if given.get(k) is not None and given[k] != v]
    if clash:
        raise InputError(f"--init {init} fixes the drafter's shape; conflicting: " + ", ".join(clash))


def train_drafter(kind: str, target_dir: str | Path, data: str | Path, out: str | Path, run: loop.RunOptions,
                  evaluation: tuple[int, int] = (8, 64), features: str | Path | None = None, **given) -> dict:
    """Train (or resume) a `kind` ("dflash" or "dflow") drafter into `out`; `run.batch` is per rank.
    `evaluation`: (held-out suite prompts, tokens each) for real tau at checkpoints. `given` holds
    DFLASH/DFLOW_DEFAULTS keys (None = not given); `features` is a cache of the target's features of
    `data` (`dflow_rt.train.features`). Returns the loop's final state."""
    out, target_dir = Path(out), Path(target_dir)
    d = loop.init_distributed(run.device)
    dev = loop.local_device(run.device)
    threads = run.set_threads(d)
    settings, state = loop.run_settings(DFLASH_DEFAULTS if kind == "dflash" else DFLOW_DEFAULTS, given, out,
                                            run.resume, kind)
    if settings.get("freeze_base"):
        if settings["base_first_round"] or given.get("base_lr_scale") not in (None, 0):
            raise InputError("--freeze-base trains the relay alone: no --base-first-round, no --base-lr-scale but 0")
        settings["base_lr_scale"] = 0.0
    loop.warn_emulated_bf16(settings, dev, d)
    # The drafter trains in float32; the frozen target runs in float32 too unless asked for bfloat16,
    # which halves its memory (a real 8B target) and casts where the two meet (`Drafter.embed`, `.logits`).
    target_dtype = getattr(torch, settings["target_dtype"])
    target = load_target(target_dir, dtype=target_dtype, device=dev).requires_grad_(False)
    digests = {"target_digest": model_digest(target_dir), "data_digest": file_digest(data)}
    if state and any(state["run"][k] != v for k, v in digests.items()):
        raise InputError("--resume needs the same --target and --data as the checkpoint's run")
    seqs = load_sequences(data)
    if int(seqs.tokens.max()) >= target.config.vocab_size:
        raise InputError(f"{data}: token ids beyond the target's vocabulary of {target.config.vocab_size}")
    drafter = (load_drafter(Path(state["_dir"]) / "model", target, dtype=torch.float32) if state else
               build_drafter(kind, target, target_dir, settings, given)).to(dev).train()
    B, s, layer_ids = drafter.block_size, settings, drafter.target_layer_ids
    if s.get("freeze_base"):
        freeze_shared_weights(drafter)
    gamma = auto_gamma(B) if s["gamma"] == "auto" else float(s["gamma"])
    distill = s.get("distill", 0.0)  # a checkpoint from before soft labels has none
    if not 0.0 <= distill <= 1.0 or (distill and not features):
        raise InputError(f"--distill {distill}: a weight in [0, 1], with --features written by `train features "
                         "--topk K`")
    objective = DraftObjective(drafter, target, gamma, rounds=s["rounds"] if kind == "dflow" else 1,
                               base_first_round=s.get("base_first_round", False), distill=distill,
                               oracle_relay=s.get("oracle_relay", False)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel
    forward = (ddp(objective, broadcast_buffers=False, device_ids=[dev] if dev.type == "cuda" else None)
               if d.world > 1 else objective)
    global_batch = state["run"]["global_batch"] if state else run.batch * d.world
    n_train = len(seqs) - s["eval_seqs"]
    if s["sequences"] is not None:
        if not 1 <= s["sequences"] <= n_train:
            raise InputError(f"--sequences {s['sequences']}: {data} has {n_train} training sequences "
                             f"({len(seqs)} less --eval-seqs {s['eval_seqs']})")
        n_train = s["sequences"]
    coverage = None
    if s["draft_vocab"]:
        ids, coverage = build_draft_vocab(seqs, target.config.vocab_size, s["draft_vocab"], list(range(n_train)))
        drafter.restrict_vocab(target, ids)
    per_token = {"feats": load_features(features, target_dir, data, layer_ids, digests)} if features else {}
    if distill:
        per_token["soft_ids"], per_token["soft_probs"] = load_soft_labels(features)
    batches = AnchorBatches(seqs, list(range(n_train)), global_batch, s["anchors"], B, objective.rounds, s["seed"],
                            d.rank, d.world, per_token)
    tokenizer = load_tokenizer(target_dir) if (target_dir / "tokenizer.json").exists() else None
    held_out = HeldOut(list(range(len(seqs) - s["eval_seqs"], len(seqs))),
                       heldout_prompts(tokenizer, evaluation[0]) if tokenizer and d.main else [],
                       stop_token_ids(tokenizer) if tokenizer else [], evaluation[1])
    task = DrafterTask(objective, forward, batches, d, out, run, s, held_out)
    cfg = run.loop_config(out, s)
    info = {"kind": kind, "settings": settings, "global_batch": global_batch, "target": str(target_dir),
            "data": str(data), **digests, "gamma": gamma, "block_size": B, "target_layer_ids": list(layer_ids),
            "mask_token_id": drafter.config.mask_token_id, "params": sum(p.numel() for p in drafter.parameters()),
            "features": str(features) if features else None, "train_sequences": n_train,
            "draft_vocab_coverage": coverage}
    out.mkdir(parents=True, exist_ok=True)
    if d.main and not state:
        print(f"{kind}: {json.dumps({k: info[k] for k in ('params', 'block_size', 'target_layer_ids', 'gamma')})}, "
              f"{n_train} training sequences of {len(seqs)}, {d.world} rank(s) x {threads} thread(s)"
              + (f", draft vocabulary {s['draft_vocab']} ({coverage:.2%} of written tokens)" if coverage else ""),
              flush=True)
    optimizer = make_optimizer(drafter, s["lr"], s["weight_decay"], s.get("relay_lr_scale", 1.0),
                               s.get("base_lr_scale", 1.0), clip_relay_apart=s.get("base_first_round", False))
    result = loop.run(cfg, drafter, optimizer, task, d, info, state)
    loop.close_distributed(d)
    return result
