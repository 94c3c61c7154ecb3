"""What a DFlash round costs at batch 1, eager and compiled, against a compiled AR step: the Runtime's
own rounds (fallback off) over the first prompts of the code suite, wall time per round after the
first, medians over prompts.

    python bench/round_cost.py --target smollm2 --drafter dflash --verify-width 4 --prompts 6
    python bench/round_cost.py --attention torch cpu   # each Runtime once per attention implementation

The first AR row named is the unit of every row's "AR steps".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflow_rt.config import RuntimeConfig
from dflow_rt.data.prompts import suite_prompts
from dflow_rt.models.bundled import load_models
from dflow_rt.runtime import Runtime

# batch 1, fallback off, greedy rounds only: also the Runtimes of step_profile.py and huge_pages.py, which
# then load the compiled rounds this script compiled
SIZES = dict(max_batch=1, max_len=512, batch_buckets=(1,), tuned=False, ar_fallback=False, sampling=False)


def per_round_ms(rt: Runtime, prompt: list[int], max_new: int) -> float:
    rid = rt.add_request(prompt, max_new_tokens=max_new)
    rt.step()  # prefill and the first round
    t, rounds = time.perf_counter(), 0
    while not rt.is_finished(rid):
        rt.step()
        rounds += 1
    ms = (time.perf_counter() - t) / max(rounds, 1) * 1e3
    rt.pop(rid)
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="dflash")
    p.add_argument("--verify-width", type=int, default=4)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attention", nargs="+", default=["auto"], metavar="IMPL",
                   help="attention implementations (RuntimeConfig.kernels), each a set of Runtimes [auto]")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = load_models(args.target, args.drafter, "cpu", args.threads, True, None)
    runtimes = {}
    for impl in args.attention:
        tag = "" if args.attention == ["auto"] else f", attention {impl}"
        kernels = {"attention": impl}
        runtimes[f"AR, compile{tag}"] = Runtime(target, None, RuntimeConfig(
            **SIZES, mode="compile", verify_width=None, kernels=kernels))
        for mode in ("eager", "compile"):
            runtimes[f"DFlash k = {args.verify_width}, {mode}{tag}"] = Runtime(target, drafter, RuntimeConfig(
                **SIZES, mode=mode, verify_width=args.verify_width, kernels=kernels))
    times: dict[str, list[float]] = {name: [] for name in runtimes}
    for prompt in suite_prompts(tokenizer, "code", args.prompts):
        for name, rt in runtimes.items():  # interleaved, so that drift reaches all alike
            times[name].append(per_round_ms(rt, prompt, args.max_new_tokens))
    ar = statistics.median(next(t for name, t in times.items() if name.startswith("AR")))
    for name, ms in times.items():
        print(f"{name}: {statistics.median(ms):.1f} ms a round ({statistics.median(ms) / ar:.2f} AR steps)")


if __name__ == "__main__":
    main()
