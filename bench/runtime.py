"""`dflow-rt bench --suite runtime`: decode speed of Runtime.step() per mode and batch size.

Two passes per configuration on identical requests:
1. end to end: `step()` wall time (median step), split into the round itself and host work
   (admission excluded: requests are admitted before timing starts), and tokens/s;
2. phases: the round's own draft, verify and accept+carry phases (`batched_round`, with the
   Runtime's kernels) run (and, for compiled modes, compiled) separately on a second Runtime,
   to show where a round's time goes (medians).
"""

from __future__ import annotations

import functools
import platform
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from dflow_rt.config import RuntimeConfig
from dflow_rt.engine.runtime import Runtime
from dflow_rt.graphs import batched_round
from dflow_rt.graphs.runner import compile_static, compiling, mark_length_dynamic


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runtime(target, drafter, mode: str, batch: int, prompts, max_new: int, width: int | None) -> Runtime:
    max_len = max(len(p) for p in prompts) + max_new + 2 * (drafter.block_size if drafter else 1)
    rt = Runtime(target, drafter, RuntimeConfig(max_batch=batch, max_len=max_len, mode=mode,
                                                batch_buckets=(batch,), verify_width=width, tuned=False))
    for p in prompts[:batch]:
        rt.add_request(p, max_new_tokens=max_new)
    rt.step()  # admission + prefill, not timed
    return rt


def end_to_end(target, drafter, configs: list[tuple[str, int]], prompts, rounds: int, width: int | None = None,
               chunk: int = 5) -> list[dict]:
    """`step()` timings of every (mode, batch) configuration, interleaved.

    All Runtimes are built (and compiled) first; then each runs `chunk` steps in turn until
    each has run `rounds`, so that slow drift in the machine's load (a shared VM's steal
    time) reaches every configuration alike. Each step is timed alone and the figures use
    the median step: one preempted step moves a mean, not a median.
    """
    runtimes, timers = [], []
    for mode, batch in configs:
        rt = _runtime(target, drafter, mode, batch, prompts, rounds * 20, width)
        device, spent = rt.state.tokens.device, [0.0]

        def timed(inner, spent=spent, device=device) -> Callable[[], None]:
            def run() -> None:
                _sync(device)
                t = time.perf_counter()
                inner()
                _sync(device)
                spent[0] += time.perf_counter() - t
            return run

        rt.rounds = {key: timed(inner) for key, inner in rt.rounds.items()}
        for _ in range(3):
            rt.step()
        runtimes.append(rt)
        timers.append(spent)
    steps: list[list[tuple[float, float, int]]] = [[] for _ in configs]  # (step s, round s, tokens)
    for done in range(0, rounds, chunk):
        for rt, spent, record in zip(runtimes, timers, steps, strict=True):
            for _ in range(min(chunk, rounds - done)):
                spent[0] = 0.0
                t = time.perf_counter()
                tokens = sum(len(v) for v in rt.step().values())
                record.append((time.perf_counter() - t, spent[0], tokens))
    rows = []
    for (_, batch), record in zip(configs, steps, strict=True):
        step_s = statistics.median(r[0] for r in record)
        host_s = statistics.median(r[0] - r[1] for r in record)
        tokens = sum(r[2] for r in record) / len(record)
        rows.append({"tokens_per_s": tokens / step_s, "round_ms": 1e3 * step_s, "host_ms": 1e3 * host_s,
                     "host_frac": host_s / step_s, "tokens_per_round": tokens / batch,
                     "mean_tokens_per_s": sum(r[2] for r in record) / sum(r[0] for r in record)})
    return rows


def phases(target, drafter, mode: str, batch: int, prompts, rounds: int, width: int | None = None) -> dict:
    """Median milliseconds of each phase of the round that runs (`batched_round.draft`, `verify` and
    `commit` with the Runtime's own plan: its kernels, the mask exclusion, the fault column), run
    apart on a second Runtime's state over the bucket `step()` would pick, greedy as the bench's
    requests are. Compiled modes compile each phase alone (`cudagraph` too: compiled, not captured)."""
    rt = _runtime(target, drafter, mode, batch, prompts, rounds * 20, width)
    plan, device = rt.plan, rt.state.tokens.device
    views = {L: rt.state.view(batch, L) for L in plan.lengths}
    fns = {"draft": functools.partial(batched_round.draft, target, drafter, plan=plan, width=plan.widths[batch]),
           "verify": functools.partial(batched_round.verify, target, plan=plan, greedy=True),
           "commit": functools.partial(batched_round.commit, plan=plan)}
    if plan.mode != "eager":
        for view in views.values():
            mark_length_dynamic(view, plan)
        # each phase compiles once per (mode, batch) configuration of the run, all in one process
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        fns = {k: compile_static(f, plan.compiler) for k, f in fns.items()}
    spent: dict[str, list[float]] = {k: [] for k in fns}

    def run(timing: bool) -> None:
        starts = rt.state.start[:batch].tolist()  # not timed; the host's positions do not move here
        _, length = rt.bucket(batch, max(starts))  # as step() picks it
        rt.prepare_attention(batch, length, starts)
        s = views[length]
        t = time.perf_counter()
        block = fns["draft"](s)
        _sync(device)
        t1 = time.perf_counter()
        verified, features = fns["verify"](s, block)
        _sync(device)
        t2 = time.perf_counter()
        fns["commit"](s, block, verified, features)
        _sync(device)
        if timing:
            for k, dt in zip(spent, (t1 - t, t2 - t1, time.perf_counter() - t2), strict=True):
                spent[k].append(dt)

    with torch.inference_mode():
        with compiling(plan.compiler, device, plan.freeze):
            for _ in range(3):
                run(False)
        for _ in range(rounds):
            run(True)
    return {f"{k}_ms": 1e3 * statistics.median(v) for k, v in spent.items()}


def bench_runtime(target, drafter, prompts: list[list[int]], modes: list[str], batches: list[int],
                  rounds: int, width: int | None = None) -> dict:
    """Figures for every (mode, batch) pair, plus the machine they were measured on; the target
    verifies the first `width` drafted positions (default all)."""
    device = target.lm_head.weight.device
    configs = [(mode, batch) for mode in modes for batch in batches]
    with torch.inference_mode():
        rows = end_to_end(target, drafter, configs, prompts, rounds, width)
    for (mode, batch), row in zip(tqdm(configs, desc="phases"), rows, strict=True):
        row |= {"mode": mode, "batch": batch} | phases(target, drafter, mode, batch, prompts, rounds, width)
    return {"suite": "runtime", "rows": rows, "rounds": rounds,
            "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}


def format_table(result: dict) -> str:
    head = "| mode | batch | tokens/s | round ms | draft ms | verify ms | accept+carry ms | host ms | host % |"
    lines = [head, "|" + "---|" * 9]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['round_ms']:.2f} | "
                     f"{r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['commit_ms']:.2f} | {r['host_ms']:.2f} | "
                     f"{100 * r['host_frac']:.1f} |")
    return "\n".join(lines)
