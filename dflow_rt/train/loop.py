"""The training loop every trainer shares: DDP setup, LR schedule, checkpoints, progress and JSON log.

A trainer supplies a `Task` (its batches, loss, held-out evaluation and export); this module owns
everything that must be identical for the target and the drafters: exact resume (weights,
optimizer, RNG, data position and step live in one checkpoint directory, swapped in atomically),
rank 0 alone writing, Ctrl-C/SIGTERM ending with a checkpoint, and a time budget turned into a
fixed step count early on so the run stays reproducible (`--steps` of the planned count replays it).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model, save_file, save_model

from dflow_rt import compat
from dflow_rt.errors import InputError

CHECKPOINT = "checkpoint"
LOG = "train_log.jsonl"
PLAN_SKIP, PLAN_STEPS = 3, 20  # a --minutes run times steps PLAN_SKIP..PLAN_STEPS of its first invocation


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "cpu") -> Dist:
    """A process group when launched by torchrun (WORLD_SIZE > 1: gloo on CPU, nccl on CUDA), else one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size())


def close_distributed(d: Dist) -> None:
    """Leave the process group together: rank 0 writes the last checkpoint and export after the loop,
    and a rank that tore gloo down meanwhile could abort at exit ("terminate called without an active
    exception", seen once in CI)."""
    if d.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bfloat16 products natively (AVX512-BF16 or AMX); without, they are emulated."""
    return compat.cpu_has_bf16()


def warn_emulated_bf16(settings: dict, device: torch.device, d: Dist) -> None:
    """bfloat16 training settings on a CPU without BF16 instructions run emulated: one such CPU (an AVX2
    EPYC) took about 25x as long an update, with nothing else to tell the user why."""
    asked = [f"--{k.replace('_', '-')} bfloat16" for k in ("amp", "target_dtype") if settings.get(k) == "bfloat16"]
    if asked and device.type == "cpu" and d.main and not cpu_has_bf16():
        print(f"warning: {' and '.join(asked)} on a CPU without BF16 instructions: bfloat16 is emulated here, "
              "many times slower than float32", file=sys.stderr, flush=True)


def local_device(device: str) -> torch.device:
    """`device` for this process: under torchrun, "cuda" means this rank's own GPU."""
    if device != "cuda":
        return torch.device(device)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    return dev


def all_mean(values: list[float], d: Dist) -> list[float]:
    """Means over ranks (one small all-reduce); identity on one process."""
    if d.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / d.world).tolist()


def lr_at(step: int, base: float, warmup: int, total: int | None, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_ratio * base` at `total`
    (constant until a time-budgeted run has planned its total)."""
    if step < warmup:
        return base * (step + 1) / warmup
    if total is None or total <= warmup:
        return base
    progress = min(1.0, (step - warmup) / (total - warmup))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class LoopConfig:
    out: Path
    lr: float
    total_steps: int | None = None  # None: plan from `minutes`
    minutes: float | None = None
    warmup: int = 100
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    checkpoint_every: int = 500
    log_every: int = 10
    run_steps: int | None = None  # stop (with a checkpoint) after this many steps of this invocation


@dataclass
class RunOptions:
    """How one invocation runs, not what it trains: none of these is part of a run's identity
    (a resumed run may change them), except `batch`, fixed by the first invocation's global batch."""

    batch: int = 4  # sequences per step per rank
    resume: bool = False
    threads: int | None = None  # torch threads per rank [cores / ranks]
    checkpoint_every: int = 500
    log_every: int = 10
    run_steps: int | None = None  # stop (with a checkpoint) after this many steps of this invocation
    device: str = "cpu"

    def set_threads(self, d: Dist) -> int:
        threads = self.threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", d.world)))
        torch.set_num_threads(threads)
        return threads

    def loop_config(self, out: Path, s: dict) -> LoopConfig:
        """The loop's settings from the run's (`s`: lr, steps or minutes, warmup, min_lr_ratio, clip)."""
        return LoopConfig(out=out, lr=s["lr"], total_steps=s["steps"], minutes=s["minutes"], warmup=s["warmup"],
                          min_lr_ratio=s["min_lr_ratio"], clip=s["clip"], checkpoint_every=self.checkpoint_every,
                          log_every=self.log_every, run_steps=self.run_steps)


def run_settings(defaults: dict, given: dict, out: Path, resume: bool, kind: str | None = None
                     ) -> tuple[dict, dict | None]:
    """A run's settings: `defaults` + `given` (the CLI's, None = not given) for a new run; the
    checkpoint's for a resumed one, where an explicit conflicting value is an error (silently
    changing a run would break exact resume). `kind` must match the checkpoint's when given."""
    unknown = set(given) - set(defaults)
    if unknown:
        raise InputError(f"{kind or 'this run'} does not take: {', '.join(sorted(unknown))}")
    state = read_state(out)
    if not resume:
        if state is not None:
            raise InputError(f"{out}/{CHECKPOINT} exists: pass --resume to continue it, or choose another --out")
        settings = {k: (given.get(k) if given.get(k) is not None else v) for k, v in defaults.items()}
        if (settings["steps"] is None) == (settings["minutes"] is None):
            raise InputError("give exactly one of --steps and --minutes")
        return settings, None
    if state is None or (kind is not None and state["run"].get("kind") != kind):
        held = f" (it holds a {state['run'].get('kind')} run)" if state else ""
        raise InputError(f"--resume: no {kind + ' ' if kind else ''}checkpoint in {out}{held}")
    settings = {**defaults, **state["run"]["settings"]}  # settings added since the run started keep their default
    clash = [f"--{k.replace('_', '-')} {v} (checkpoint: {settings[k]})" for k, v in given.items()
             if v is not None and v != settings[k]]
    if clash:
        raise InputError("--resume keeps the checkpoint's settings; conflicting: " + ", ".join(clash))
    return settings, state


class Task(Protocol):
    """What a trainer plugs into `run`."""

    def loss(self, step: int) -> tuple[torch.Tensor, int]:
        """Forward the next batch of this rank: (mean loss to backpropagate, tokens in it)."""

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (called on rank 0 only)."""

    def state(self) -> dict:
        """JSON-able data position."""

    def load_state(self, state: dict) -> None: ...

    def export(self, directory: Path) -> None:
        """Write the usable model directory (final output, and a copy in each checkpoint)."""


class JsonLog:
    """Append-only JSON lines on rank 0 (a resumed run appends to the same file)."""

    def __init__(self, path: Path, d: Dist):
        self.path, self.on = path, d.main

    def write(self, event: str, **fields) -> None:
        if self.on:
            with self.path.open("a") as fh:
                fh.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")


class StopRequest:
    """SIGINT/SIGTERM set a flag that the loop checks between steps (a second Ctrl-C aborts)."""

    def __init__(self):
        self.flag = False

    def _handle(self, signum, frame):
        if self.flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = True

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": v.contiguous() for i, s in sd["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    scalars = {f"{i}.{k}": v for i, s in sd["state"].items() for k, v in s.items() if not torch.is_tensor(v)}
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for name, value in [*tensors.items(), *meta["scalars"].items()]:
        i, key = name.split(".", 1)
        state.setdefault(int(i), {})[key] = value
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict,
                    d: Dist, task: Task) -> None:
    """Write OUT/checkpoint (all ranks call: RNG states are gathered; rank 0 writes, then swaps it in)."""
    rng = [torch.get_rng_state()]
    if d.world > 1:
        rng = [None] * d.world
        dist.all_gather_object(rng, torch.get_rng_state())
    if not d.main:
        return
    tmp, final, old = out / (CHECKPOINT + ".tmp"), out / CHECKPOINT, out / (CHECKPOINT + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "weights.safetensors"))
    tensors, meta = _optimizer_tensors(opt)
    save_file(tensors, tmp / "optimizer.safetensors")
    save_file({f"rank{r}": t for r, t in enumerate(rng)}, tmp / "rng.safetensors")
    task.export(tmp / "model")
    (tmp / "state.json").write_text(json.dumps({**state, "optimizer": meta}, indent=1) + "\n")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def read_state(out: Path) -> dict | None:
    """The checkpoint's state.json (falling back to the previous one if a swap was cut short)."""
    for name in (CHECKPOINT, CHECKPOINT + ".old"):
        path = out / name / "state.json"
        if path.exists():
            return {**json.loads(path.read_text()), "_dir": str(out / name)}
    return None


def load_checkpoint(state: dict, model: torch.nn.Module, opt: torch.optim.Optimizer, d: Dist) -> None:
    directory = Path(state["_dir"])
    load_model(model, directory / "weights.safetensors")
    _load_optimizer(opt, load_file(directory / "optimizer.safetensors"), state["optimizer"])
    rng = load_file(directory / "rng.safetensors")
    torch.set_rng_state(rng.get(f"rank{d.rank}", rng["rank0"]))  # a new world size reuses rank 0's


def _progress(total: int | None, initial: int, d: Dist):
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, disable=not d.main, unit="step", dynamic_ncols=tty,
                mininterval=0.5 if tty else 30.0, smoothing=0.05)


def clip_gradients(model: torch.nn.Module, opt: torch.optim.Optimizer, clip: float) -> float:
    """Clip the gradient norm to `clip` over all of `model`'s parameters, except those of optimizer groups
    marked `clip_apart`, which are clipped as a set of their own (so that their gradients cannot shrink
    the others' steps). Returns the norm over all parameters before clipping."""
    apart = {id(p) for g in opt.param_groups if g.get("clip_apart") for p in g["params"]}
    if not apart:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    params = list(model.parameters())
    norms = [torch.nn.utils.clip_grad_norm_([p for p in params if (id(p) in apart) == side], clip)
             for side in (False, True)]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def run(cfg: LoopConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, task: Task, d: Dist,
        run_info: dict, resume: dict | None = None) -> dict:
    """Train `model` (the bare module; the task forwards through its DDP wrapper) until `total_steps`,
    a stop request or `run_steps`. Returns the final state (step, tokens, elapsed_s, total_steps, finished)."""
    log = JsonLog(cfg.out / LOG, d)
    state = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "total_steps": cfg.total_steps, "run": run_info}
    if resume is not None:
        load_checkpoint(resume, model, opt, d)
        task.load_state(resume["data"])
        state.update({k: resume[k] for k in ("step", "tokens", "elapsed_s", "total_steps")})
        log.write("resume", step=state["step"])
    else:
        log.write("start", **run_info, world=d.world, loop={k: str(v) for k, v in asdict(cfg).items()})
    start_step, t0 = state["step"], time.perf_counter()
    base_elapsed, plan_t = state["elapsed_s"], None
    bar = _progress(state["total_steps"], start_step, d)
    window_t, window_tokens, losses = time.perf_counter(), 0, []
    finished = state["total_steps"] is not None and state["step"] >= state["total_steps"]
    with StopRequest() as stop:
        while state["total_steps"] is None or state["step"] < state["total_steps"]:
            step = state["step"]
            lr = lr_at(step, cfg.lr, cfg.warmup, state["total_steps"], cfg.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            loss, n_tokens = task.loss(step)
            loss.backward()
            grad_norm = clip_gradients(model, opt, cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mean_loss, stop_votes, mean_tokens = all_mean([float(loss.detach()), float(stop.flag), n_tokens], d)
            step_tokens = round(mean_tokens * d.world)
            state["step"], state["tokens"] = step + 1, state["tokens"] + step_tokens
            state["elapsed_s"] = base_elapsed + time.perf_counter() - t0
            window_tokens += step_tokens
            losses.append(mean_loss)
            done_here = state["step"] - start_step
            if state["total_steps"] is None and done_here == PLAN_SKIP:
                plan_t = time.perf_counter()
            if state["total_steps"] is None and done_here == PLAN_STEPS:  # every rank plans the same
                per_step, elapsed = all_mean([(time.perf_counter() - plan_t) / (PLAN_STEPS - PLAN_SKIP),
                                              state["elapsed_s"]], d)
                left = cfg.minutes * 60 * 0.98 - elapsed  # 2 %: evaluations and checkpoints
                state["total_steps"] = max(state["step"] + 1, state["step"] + int(left / per_step))
                bar.total = state["total_steps"]
                log.write("plan", step=state["step"], total_steps=state["total_steps"], s_per_step=per_step)
            if state["step"] % cfg.log_every == 0 or state["step"] == state["total_steps"]:
                rate = window_tokens / max(time.perf_counter() - window_t, 1e-9)
                log.write("train", step=state["step"], loss=round(sum(losses) / len(losses), 5),
                          last_loss=mean_loss, lr=lr, grad_norm=round(grad_norm, 4), tokens=state["tokens"],
                          tokens_per_s=round(rate, 1), elapsed_s=round(state["elapsed_s"], 1))
                window_t, window_tokens, losses = time.perf_counter(), 0, []
                bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{rate:.0f}", lr=f"{lr:.2e}", refresh=False)
            bar.update(1)
            finished = state["step"] == state["total_steps"]
            halt = stop_votes > 0 or (cfg.run_steps is not None and done_here >= cfg.run_steps)
            if finished or halt or state["step"] % cfg.checkpoint_every == 0:
                if d.main:
                    metrics = task.evaluate()
                    log.write("eval", step=state["step"], **metrics)
                    bar.write(f"step {state['step']}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
                save_checkpoint(cfg.out, model, opt, {**state, "data": task.state()}, d, task)
                log.write("checkpoint", step=state["step"])
                window_t = time.perf_counter()  # the next rate excludes evaluation and saving
                window_tokens = 0
            if finished or halt:
                break
    bar.close()
    if finished and d.main:
        task.export(cfg.out)
    log.write("end" if finished else "stopped", step=state["step"], tokens=state["tokens"],
              elapsed_s=round(state["elapsed_s"], 1))
    return {**state, "finished": finished}
