"""Compiled AR steps with the target's weights in huge pages against 4 KB pages: two Runtimes of the
same target in one process (`DFLOW_RT_HUGE_PAGES` set before each), their steps interleaved prompt
by prompt, so that the machine's drift reaches both alike.

    python bench/huge_pages.py --target smollm2 --threads 2 --prompts 6
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from round_cost import SIZES, per_round_ms  # bench/ is on the path when run as a script

from dflow_rt.config import RuntimeConfig
from dflow_rt.data.prompts import suite_prompts
from dflow_rt.engine.runtime import Runtime
from dflow_rt.models.bundled import load_models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runtimes = {}
    for name, env in (("huge pages", "1"), ("4 KB pages", "0")):
        os.environ["DFLOW_RT_HUGE_PAGES"] = env
        target, _, tokenizer = load_models(args.target, None, "cpu", args.threads, True, None)
        runtimes[name] = Runtime(target, None, RuntimeConfig(**SIZES, mode="compile", verify_width=None))
    granted = [line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")]
    print(f"huge pages granted to this process: {granted[0] if granted else '?'} kB")
    times: dict[str, list[float]] = {name: [] for name in runtimes}
    for _ in range(args.passes):
        for prompt in suite_prompts(tokenizer, "code", args.prompts):
            for name, rt in runtimes.items():
                times[name].append(per_round_ms(rt, prompt, args.max_new_tokens))
    for name, ms in times.items():
        print(f"{name}: AR step {statistics.median(ms):.2f} ms (median of {len(ms)} prompts)")
    ratios = [a / b for a, b in zip(times["4 KB pages"], times["huge pages"], strict=True)]
    print(f"4 KB / huge, per prompt: median {statistics.median(ratios):.3f}, {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
