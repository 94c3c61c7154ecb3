"""Pretraining the target from scratch: a small tied-embedding Qwen3 on the offline corpora.

The output directory is a Hugging Face model directory (config, safetensors, tokenizer,
generation_config) that loads with `dflow_rt.load_target` and `AutoModelForCausalLM`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from dflow_rt.data.corpus import Mix, PackedStream, eval_windows
from dflow_rt.errors import InputError
from dflow_rt.models.checkpoint import save_model
from dflow_rt.models.target import Target, TargetConfig
from dflow_rt.train import loop
from dflow_rt.train.settings import TARGET_DEFAULTS

ROPE_THETA = 10_000.0  # short training sequences: the Qwen3 default 1e6 would waste rotary resolution


def build_target(vocab_size: int, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
                 seed: int) -> Target:
    """A fresh Qwen3 with tied embeddings, GPT-2 style init (residual outputs scaled by 1/sqrt(2*layers))."""
    torch.manual_seed(seed)
    model = Target(TargetConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads, rope_theta=ROPE_THETA,
        tie_word_embeddings=True, max_position_embeddings=4096, model_type="qwen3"))
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / (2 * layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, std=std)
    return model


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW decaying matrices only (norm gains stay undecayed)."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lm_loss(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over windows [batch, seq + 1]."""
    ids = rows[:, :-1]
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    logits, _ = model(ids, positions)
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())


def export_target(model: Target, tokenizer, directory: Path) -> None:
    """Model + tokenizer + generation_config: a directory `load_target` and transformers both read."""
    save_model(model, directory)
    tokenizer.save_pretrained(directory)
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id}, indent=1) + "\n")


class TargetTask:
    def __init__(self, model: Target, forward: torch.nn.Module, stream: PackedStream, tokenizer,
                 eval_per_source: int, eval_batch: int):
        self.model, self.forward, self.stream, self.tokenizer = model, forward, stream, tokenizer
        self.eval_per_source, self.eval_batch, self._eval = eval_per_source, eval_batch, None

    def loss(self, step: int) -> tuple[torch.Tensor, int]:
        rows = self.stream.next()
        return lm_loss(self.forward, rows), rows[:, 1:].numel()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss per source; `heldout_loss` is the stdlib one (the figure model cards quote)."""
        if self._eval is None:
            self._eval = eval_windows(self.tokenizer, self.stream.seq_len, self.eval_per_source)
        self.model.eval()
        out = {}
        for name, windows in self._eval.items():
            if len(windows):
                losses = [lm_loss(self.model, w) * len(w) for w in windows.split(self.eval_batch)]
                out["heldout_loss" if name == "stdlib" else f"heldout_{name}"] = float(sum(losses) / len(windows))
        self.model.train()
        return out

    def state(self) -> dict:
        return self.stream.state()

    def load_state(self, state: dict) -> None:
        self.stream.load_state(state)

    def export(self, directory: Path) -> None:
        export_target(self.model, self.tokenizer, Path(directory))


def tokenizer_digest(directory: str | Path) -> str:
    return hashlib.sha256((Path(directory) / "tokenizer.json").read_bytes()).hexdigest()[:16]


def train_target(tokenizer_dir: str | Path, out: str | Path, run: loop.RunOptions, **given) -> dict:
    """Pretrain (or resume) a target into `out`; `run.batch` is per rank (global = batch x world size).
    `given` holds TARGET_DEFAULTS keys (None = not given). Returns the loop's final state."""
    from dflow_rt.tokenizer import load_tokenizer

    out = Path(out)
    d = loop.init_distributed()
    threads = run.set_threads(d)
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # the tokenizer's pool, created on first use
    settings, state = loop.run_settings(TARGET_DEFAULTS, given, out, run.resume)
    global_batch = state["run"]["global_batch"] if state else run.batch * d.world
    digest = tokenizer_digest(tokenizer_dir)
    if state and state["run"]["tokenizer_sha256"] != digest:
        raise InputError(f"--tokenizer {tokenizer_dir} differs from the one the checkpoint was trained with")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_dir)
    s = settings
    model = build_target(len(tokenizer), s["layers"], s["hidden"], s["heads"], s["kv_heads"], s["ffn"], s["seed"])
    forward = model
    if d.world > 1:
        forward = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    mix = Mix(math_docs=s["math_per_epoch"], math_chats=s["math_chat_per_epoch"], max_files=s["max_files"])
    stream = PackedStream(tokenizer, s["seq_len"], global_batch, s["seed"], mix, d.rank, d.world)
    task = TargetTask(model, forward, stream, tokenizer, s["eval_windows"], max(1, global_batch // d.world))
    cfg = run.loop_config(out, s)
    info = {"settings": settings, "global_batch": global_batch, "tokenizer_sha256": digest,
            "params": sum(p.numel() for p in model.parameters()), "mix": asdict(mix)}
    if d.main and not state:
        print(f"target: {info['params'] / 1e6:.2f}M parameters, global batch {global_batch} x {s['seq_len']} "
              f"tokens, {d.world} rank(s) x {threads} thread(s)", flush=True)
    result = loop.run(cfg, model, adamw(model, s["lr"], s["weight_decay"]), task, d, info, state)
    loop.close_distributed(d)
    return result
