"""What a verify pass costs against an autoregressive step: the target's forward over n new tokens
after a cache of `--context` positions, per dtype, eager, on this machine.

Speculation pays only when a round (a draft pass plus an n-token verify) costs less than tau AR
steps, so the ratio verify(n) / verify(1) decides, per machine and dtype, which verify widths can
pay. Calls of every (dtype, n) are interleaved and repeated; medians.

Usage: python bench/verify_cost.py [--target smollm2] [--tokens 1 2 4 8 16] [--dtypes float32 bfloat16]
       [--context 128] [--repeats 30] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from dflow_rt.bench.report import machine
from dflow_rt.config import DTYPES
from dflow_rt.models.bundled import target_dir
from dflow_rt.models.checkpoint import load_target
from dflow_rt.models.layers import KVCache


def forward_ms(target, n: int, context: int) -> Callable[[], float]:
    """A callable that runs one n-token forward after `context` cached positions; returns ms."""
    c = target.config
    cache = KVCache(c.num_hidden_layers, 1, c.num_key_value_heads, context + n, c.head_dim,
                    target.lm_head.weight.dtype, "cpu")
    with torch.inference_mode():
        target(torch.randint(c.vocab_size, (1, context)), torch.arange(context)[None], cache)
    ids, positions = torch.randint(c.vocab_size, (1, n)), torch.arange(context, context + n)[None]

    @torch.inference_mode()
    def call() -> float:
        t = time.perf_counter()
        target(ids, positions, cache)
        return (time.perf_counter() - t) * 1e3
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2", help="smollm2 (fetched), a directory, or '' for the bundled one")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = target_dir(args.target or None)
    calls = {}
    for dtype in args.dtypes:
        target = load_target(path, dtype=getattr(torch, dtype))
        for n in args.tokens:
            calls[dtype, n] = forward_ms(target, n, args.context)
    times: dict = {key: [] for key in calls}
    for _ in range(3):  # warm-up
        for call in calls.values():
            call()
    for _ in range(args.repeats):
        for key, call in calls.items():
            times[key].append(call())
    ms = {f"{d} n={n}": round(statistics.median(t), 2) for (d, n), t in times.items()}
    info = machine(torch.device("cpu"))
    print(f"{info['cpu']}, {info['cpu_capability']}, torch {info['torch']}, {info['date']}")
    print(f"{path.name}: forward ms over a {args.context}-position cache, {args.threads} thread(s), medians of "
          f"{args.repeats}\n| dtype | " + " | ".join(f"n = {n}" for n in args.tokens) + " |\n|---|"
          + "---|" * len(args.tokens))
    for d in args.dtypes:
        one = ms[f"{d} n=1"] if 1 in args.tokens else None
        cells = [f"{ms[f'{d} n={n}']:.1f}" + (f" ({ms[f'{d} n={n}'] / one:.2f}x)" if one else "") for n in args.tokens]
        print(f"| {d} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": path.name, "context": args.context, "threads": args.threads, "repeats": args.repeats,
                       "median_ms": ms, "machine": info}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
