"""Compiled rounds with dynamo's guard check on every call (as torch runs a saved graph) against the
Runtime's own, which checks them when a request is admitted: our AR and the defaults (k = 4, the
fallback, lookup rounds), each both ways, interleaved prompt by prompt, per suite; decode tokens/s
and whether both ways emit the same tokens.

    python bench/guard_checks.py --suites code math chat --prompts 8 --max-new-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from round_cost import SIZES  # bench/ is on the path when run as a script

from dflow_rt.config import RuntimeConfig
from dflow_rt.data.prompts import suite_prompts
from dflow_rt.engine.runtime import Runtime
from dflow_rt.models.bundled import load_models


def decode(rt: Runtime, prompt: list[int], max_new: int) -> tuple[float, int, list[int]]:
    """Seconds of every round after the first, the tokens they emitted, and all tokens emitted."""
    rid = rt.add_request(prompt, max_new_tokens=max_new)
    first = len(rt.step().get(rid, ()))  # prefill and the first round
    t = time.perf_counter()
    while not rt.is_finished(rid):
        rt.step()
    seconds = time.perf_counter() - t
    emitted = rt.pop(rid).emitted
    return seconds, len(emitted) - first, emitted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="dflash")
    p.add_argument("--suites", nargs="+", default=["code", "math", "chat"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = load_models(args.target, args.drafter, "cpu", args.threads, True, None)
    defaults = dict(SIZES, ar_fallback=True, lookup=True, verify_width=4)
    runtimes = {}
    for name, model, kw in (("AR", None, dict(SIZES, verify_width=None)), ("defaults", drafter, defaults)):
        for way in ("every call", "at admission"):
            rt = Runtime(target, model, RuntimeConfig(**kw, mode="compile"))
            if way == "every call":  # back to torch's own behaviour for a saved graph (no public switch)
                for run in rt.rounds.values():
                    if hasattr(getattr(run, "func", None), "disable_guard_check"):
                        run.func._guard_check_enabled = True
            runtimes[f"{name}, guards checked {way}"] = rt
    print(f"{torch.__version__}, {args.threads} threads, {args.prompts} prompts a suite, {args.max_new_tokens} tokens")
    for suite in args.suites:
        seconds, timed, tokens = ({name: [] for name in runtimes} for _ in range(3))
        for prompt in suite_prompts(tokenizer, suite, args.prompts):
            for name, rt in runtimes.items():  # interleaved, so that drift reaches all alike
                for into, value in zip((seconds, timed, tokens), decode(rt, prompt, args.max_new_tokens), strict=True):
                    into[name].append(value)
        for name in runtimes:
            rate = sum(timed[name]) / sum(seconds[name])
            print(f"{suite}: {name}: {rate:.1f} tokens/s")
        for model in ("AR", "defaults"):
            on, off = (f"{model}, guards checked {way}" for way in ("every call", "at admission"))
            ratio = statistics.median(a / b for a, b in zip(seconds[on], seconds[off], strict=True))
            print(f"{suite}: {model}: admission-only {ratio:.3f}x the per-call check (median over prompts); "
                  f"same tokens: {tokens[on] == tokens[off]}")


if __name__ == "__main__":
    main()
