"""`dflow-rt soak`: a long Runtime run under churn, checked for drift and for exact outputs.

Requests arrive and leave all the time (mixed prompt lengths and output lengths, greedy and
seeded sampling, stop tokens, cancellations), and bad requests are injected between good ones.
Reported against targets:
- resident memory after warm-up vs at the end (<= 5 % growth);
- graphs compiled after construction (torch._dynamo counters; 0);
- greedy requests identical to plain autoregressive decoding (`generate` with drafter=None),
  seeded ones identical to the same request run alone (100 %; a cancelled one, a prefix);
- bad requests refused with InputError by add_request, leaving the Runtime as it was (100 %);
- rounds per second of step() in each tenth of the run (flat: slowest / fastest tenth).
Expected outputs come from a fixed pool of requests computed before the run, so the checks
allocate nothing while memory is measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import subprocess
import time
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters
from tqdm import tqdm

import dflow_rt
import dflow_rt.oracle
from dflow_rt.checks import cut_at_stop
from dflow_rt.config import MODES, RuntimeConfig
from dflow_rt.engine.runtime import Runtime
from dflow_rt.errors import DflowError, InputError

SAMPLING = ((0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 0.9), (0.3, 0, 0.95))  # (temperature, top_k, top_p)
LENGTHS = (6, 24, 64, 160)  # prompt lengths, cycled over the pool
TARGETS = {"rss_growth": 0.05, "recompiles": 0, "exact": 1.0, "bad_refused": 1.0}


@dataclass(frozen=True)
class Soak:
    """A soak's size: `rounds` steps of a `max_batch` x `max_len` Runtime in `mode`, its requests drawn
    (with `seed`) from `prompts` distinct prompts, each asking for one of the `max_new` token counts."""

    rounds: int = 10_000
    mode: str = "eager"
    max_batch: int = 4
    max_len: int = 512
    prompts: int = 24
    max_new: tuple[int, ...] = (8, 32, 96, 160)
    seed: int = 0


@dataclass
class Pool:
    """Prompts and the full expected output of each (prompt, sampling) pair, up to `max_new` tokens."""

    prompts: list[list[int]]
    expected: dict[tuple[int, int], list[int]]
    stops: tuple[frozenset[int], ...]
    max_new: tuple[int, ...]


def build_pool(target, drafter, tokenizer, n_prompts: int, max_new: tuple[int, ...], max_len: int) -> Pool:
    """Held-out code/math/chat prompts cut to mixed lengths; greedy expectations by plain AR decoding,
    sampled ones by a batch-1 Runtime holding only that request (seed = 1000 + setting)."""
    from dflow_rt.data.prompts import suite_prompts
    from dflow_rt.tokenizer import stop_token_ids

    per_suite = -(-n_prompts // 3)
    base = [p for s in ("code", "math", "chat") for p in suite_prompts(tokenizer, s, per_suite)]
    prompts = [p[-LENGTHS[i % len(LENGTHS)]:] for i, p in enumerate(base[:n_prompts])]
    alone = Runtime(target, drafter, RuntimeConfig(max_batch=1, max_len=max_len, mode="eager",
                                                   verify_width=None, tuned=False))
    expected = {}
    for i, p in enumerate(tqdm(prompts, desc="expected outputs", leave=False)):
        expected[i, 0] = dflow_rt.oracle.generate(target, None, p, max_new_tokens=max(max_new)).token_ids
        for j, (t, k, top_p) in enumerate(SAMPLING[1:], start=1):
            expected[i, j] = alone.generate([p], max_new_tokens=max(max_new), temperature=t, top_k=k, top_p=top_p,
                                            seed=1000 + j)[0]
    newline = tokenizer.encode("\n", add_special_tokens=False)
    stops = (frozenset(), frozenset(stop_token_ids(tokenizer)), frozenset(newline[-1:]))
    return Pool(prompts, expected, stops, max_new)


def bad_requests(vocab: int, max_len: int) -> list[dict]:
    """Requests add_request must refuse: one bad field each (type, range, shape or fit)."""
    good = {"prompt_ids": [5, 6, 7], "max_new_tokens": 8}
    changes = [
        {"prompt_ids": []}, {"prompt_ids": [vocab]}, {"prompt_ids": [-1]}, {"prompt_ids": "def f():"},
        {"prompt_ids": [[1, 2]]}, {"prompt_ids": [1.0, 2.0]}, {"prompt_ids": torch.zeros(2, 2, dtype=torch.long)},
        {"prompt_ids": [True, 1]}, {"prompt_ids": [1] * max_len}, {"max_new_tokens": 0}, {"max_new_tokens": 5.0},
        {"max_new_tokens": max_len}, {"temperature": -0.5}, {"temperature": float("nan")}, {"temperature": "hot"},
        {"top_k": -1}, {"top_k": True}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1}, {"seed": 2**64},
        {"stop_token_ids": "ab"}, {"stop_token_ids": [vocab]}, {"stop_token_ids": [1.5]}, {"prompt_ids": None},
    ]
    return [good | change for change in changes]


def snapshot(rt: Runtime) -> tuple:
    """What a refused request must not change."""
    return (sorted(rt.requests), [r.rid for r in rt.scheduler.waiting], sorted(rt.scheduler.free_rows),
            [r.rid if r else None for r in rt.rows])


def rss_bytes() -> int:
    """Current resident memory of this process (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def run_soak(target, drafter, tokenizer, soak: Soak = Soak(), progress: bool = True) -> dict:
    """Run `soak.rounds` steps under churn and return the figures (see the module docstring)."""
    rounds, mode, max_batch, max_len = soak.rounds, soak.mode, soak.max_batch, soak.max_len
    rng = random.Random(soak.seed)
    pool = build_pool(target, drafter, tokenizer, soak.prompts, soak.max_new, max_len)
    rt = Runtime(target, drafter, RuntimeConfig(max_batch=max_batch, max_len=max_len, mode=mode,
                                                verify_width=None, tuned=False))
    graphs, bad = graphs_compiled(), bad_requests(target.config.vocab_size, max_len)
    meta: dict[int, tuple] = {}  # rid -> (prompt, setting, max_new, stop kind)
    tally = {"finished": 0, "cancelled": 0, "exact": 0, "failed": 0, "bad": 0, "bad_refused": 0, "mismatches": []}
    step_s, window_rounds, warm_rss, last_rid = [0.0] * 10, [0] * 10, 0, None

    def check(rid: int, cancelled: bool) -> None:
        req = rt.pop(rid)
        i, j, n, s = meta.pop(rid)
        full, _ = cut_at_stop(pool.expected[i, j][:n], pool.stops[s])
        ok = req.emitted == full[:len(req.emitted)] if cancelled else req.emitted == full
        tally["cancelled" if cancelled else "finished"] += 1
        tally["failed"] += req.error is not None
        tally["exact"] += ok and req.error is None
        if not ok and len(tally["mismatches"]) < 5:
            tally["mismatches"].append({"prompt": i, "sampling": j, "max_new": n, "stop": s, "cancelled": cancelled})

    warmup = max(rounds // 10, 1)
    for r in tqdm(range(rounds), desc=f"soak ({mode})", disable=not progress, mininterval=2):
        if r == warmup:
            gc.collect()
            warm_rss = rss_bytes()
        desired = 1 + (r // 25) % (max_batch + 2)  # the load swings from one request to a queue
        while len(meta) < desired:
            i, j = rng.randrange(len(pool.prompts)), rng.randrange(len(SAMPLING))
            n, s = rng.choice(pool.max_new), rng.randrange(len(pool.stops))
            t, k, p = SAMPLING[j]
            rid = rt.add_request(pool.prompts[i], max_new_tokens=n, temperature=t, top_k=k, top_p=p,
                                 stop_token_ids=pool.stops[s], seed=1000 + j if j else None)
            assert last_rid is None or rid == last_rid + 1, "a refused request used up a request id"
            meta[rid], last_rid = (i, j, n, s), rid
        if r % 7 == 3:  # a bad request between good ones
            before, kwargs = snapshot(rt), bad[(r // 7) % len(bad)]
            tally["bad"] += 1
            try:
                rid = rt.add_request(**kwargs)
            except InputError:
                tally["bad_refused"] += snapshot(rt) == before
            else:  # accepted: counted as a miss, and dropped
                rt.cancel(rid)
                rt.pop(rid)
                last_rid = rid
        if rng.random() < 0.02:
            victim = rng.choice(sorted(meta))
            rt.cancel(victim)
            check(victim, cancelled=True)
        t0 = time.perf_counter()
        rt.step()
        step_s[r * 10 // rounds] += time.perf_counter() - t0
        window_rounds[r * 10 // rounds] += 1
        for rid in [rid for rid in meta if rt.is_finished(rid)]:
            check(rid, cancelled=False)
    gc.collect()
    end_rss = rss_bytes()
    for rid in sorted(meta):
        rt.cancel(rid)
        check(rid, cancelled=True)
    done = tally["finished"] + tally["cancelled"]
    windows = [round(n / s, 2) if s else 0.0 for n, s in zip(window_rounds, step_s, strict=True)]
    result = {
        "rounds": rounds, "mode": mode, "max_batch": max_batch, "max_len": max_len,
        "rss_after_warmup_mib": round(warm_rss / 2**20, 1), "rss_end_mib": round(end_rss / 2**20, 1),
        "rss_growth": round(end_rss / warm_rss - 1, 4) if warm_rss else 0.0,
        "recompiles": graphs_compiled() - graphs, "requests": done, **tally,
        "exact_fraction": tally["exact"] / max(done, 1),
        "bad_refused_fraction": tally["bad_refused"] / max(tally["bad"], 1),
        "rounds_per_s_by_tenth": windows, "flatness": round(min(windows) / max(windows), 3) if max(windows) else 0.0,
        "leaked_records": len(rt.requests), "free_rows": len(rt.scheduler.free_rows),
    }
    result["targets_met"] = {"rss_growth": result["rss_growth"] <= TARGETS["rss_growth"],
                             "recompiles": result["recompiles"] == TARGETS["recompiles"],
                             "exact": result["exact_fraction"] >= TARGETS["exact"],
                             "bad_refused": result["bad_refused_fraction"] >= TARGETS["bad_refused"]}
    return result


def machine() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    except (OSError, StopIteration, subprocess.SubprocessError):
        return platform.processor() or platform.machine()


def cmd_soak(args: argparse.Namespace) -> None:
    from dflow_rt.models.bundled import load_models

    args.drafter, args.target = args.drafter or "dflash", None
    target, drafter, tokenizer = load_models(args.target, args.drafter, args.device, args.threads)
    t0 = time.perf_counter()
    result = run_soak(target, drafter, tokenizer, Soak(args.rounds, args.mode, args.max_batch, args.max_len,
                                                       args.prompts, seed=args.seed))
    result |= {"drafter": args.drafter, "machine": machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.perf_counter() - t0)}
    print(json.dumps({k: v for k, v in result.items() if k != "mismatches"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    missed = [k for k, ok in result["targets_met"].items() if not ok]
    if missed:
        raise DflowError(f"soak missed its targets: {', '.join(missed)} (figures above)")


def add_soak_parser(subparsers) -> None:
    """Register `dflow-rt soak` on the CLI's subparsers."""
    s = subparsers.add_parser("soak", help="a long Runtime run under churn: memory, recompiles, exactness, speed")
    s.add_argument("--rounds", type=int, default=10_000)
    s.add_argument("--mode", choices=MODES, default="compile")
    s.add_argument("--drafter", default=None, help="dflash or dflow (bundled) or a drafter directory [dflash]")
    s.add_argument("--max-batch", type=int, default=4)
    s.add_argument("--max-len", type=int, default=512)
    s.add_argument("--prompts", type=int, default=24, help="distinct prompts in the request pool")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=1, help="CPU threads [1]")
    s.add_argument("--device", default=None)
    s.add_argument("--json", default=None, metavar="OUT")
    s.set_defaults(run=cmd_soak)
