"""Our AR against drafted Runtimes with the fallback (the defaults: k = 4) with lookup rounds off and
on, per verify width k given, the Runtimes interleaved prompt by prompt, per suite: decode tokens/s,
and where each one's time goes by round kind (width 1, 2, 4, L for lookup), in AR steps (the median
AR step) and tokens a round.
First, from our AR's own greedy output, how often the last n tokens occurred before and what their
continuation then would have emitted in a round at width 4 (the lookup's match length n).

    python bench/lookup_ab.py --suites code chat math --prompts 12 --max-new-tokens 96 --reps 2 --threads 2 \
        [--verify-widths 2 4] [--drafter dflash DIR --lookup on]

With several drafters, each one's Runtimes join the interleaving (the defaults of two drafters, paired).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from round_cost import SIZES  # bench/ is on the path when run as a script

from dflow_rt.config import RuntimeConfig
from dflow_rt.data.prompts import suite_prompts
from dflow_rt.engine.lookup import NgramIndex
from dflow_rt.engine.runtime import Runtime
from dflow_rt.models.bundled import drafter_dir, load_models
from dflow_rt.models.checkpoint import load_drafter


def run(rt: Runtime, prompt: list[int], max_new: int) -> tuple[list[tuple[str, float, int]], list[int]]:
    """(round kind, seconds, tokens) of every round after the first, and the tokens emitted."""
    rid = rt.add_request(prompt, max_new_tokens=max_new)
    rt.step()  # prefill and the first round
    rounds = []
    while not rt.is_finished(rid):
        req, width = rt.requests[rid], rt.policy.width(1) if rt.policy else 1
        before = req.lookup_rounds
        t = time.perf_counter()
        tokens = len(rt.step().get(rid, ()))
        rounds.append(("L" if req.lookup_rounds > before else str(width), time.perf_counter() - t, tokens))
    return rounds, rt.pop(rid).emitted


def matches(prompt: list[int], output: list[int], n: int, width: int) -> tuple[float, float]:
    """Over rounds at `width` through `output` where each round verifies the lookup drafts of match
    length n: the share of rounds with drafts, and tokens a round among those."""
    index, at, found, emitted = NgramIndex(prompt + output[:1], n), 0, [], []
    while at < len(output) - 1:
        drafts = index.drafts(width - 1)
        accepted = next((i for i, t in enumerate(drafts) if at + 1 + i >= len(output) or output[at + 1 + i] != t),
                        len(drafts))
        found.append(bool(drafts))
        if drafts:
            emitted.append(1 + accepted)
        index.extend(output[at + 1:at + 2 + accepted])
        at += 1 + accepted
    return sum(found) / max(len(found), 1), statistics.mean(emitted) if emitted else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", nargs="+", default=["dflash"], help="one or more drafters, names or directories")
    p.add_argument("--lookup", choices=["both", "on", "off"], default="both", help="the Runtimes' lookup rounds")
    p.add_argument("--suites", nargs="+", default=["code", "chat", "math"])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--verify-widths", type=int, nargs="+", default=[4])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, _, tokenizer = load_models(args.target, None, "cpu", args.threads, True, None)
    runtimes = {"AR": Runtime(target, None, RuntimeConfig(**SIZES, mode="compile", verify_width=None))}
    lookups = {"both": (False, True), "on": (True,), "off": (False,)}[args.lookup]
    for spec in args.drafter:
        drafter = load_drafter(drafter_dir(spec, args.target), target)
        label = f"{Path(spec).name}, " if len(args.drafter) > 1 else ""
        for k in args.verify_widths:
            for lookup in lookups:
                settings = dict(SIZES, mode="compile", verify_width=k, ar_fallback=True, lookup=lookup)
                name = f"{label}k = {k}, lookup {'on' if lookup else 'off'}"
                runtimes[name] = Runtime(target, drafter, RuntimeConfig(**settings))
    for suite in args.suites:
        prompts = suite_prompts(tokenizer, suite, args.prompts)
        for rep in range(args.reps):
            rounds, outputs = defaultdict(list), []
            for prompt in prompts:  # interleaved, so that drift reaches all alike
                emitted = {}
                for name, rt in runtimes.items():
                    done, emitted[name] = run(rt, prompt, args.max_new_tokens)
                    rounds[name] += done
                if len(set(map(tuple, emitted.values()))) != 1:
                    raise SystemExit(f"{suite}: the Runtimes' tokens differ")
                outputs.append((prompt, emitted["AR"]))
            if rep == 0:
                for n in (2, 3, 4):
                    found = [matches(list(p), o, n, 4) for p, o in outputs]
                    print(f"{suite}, match length {n}: drafts in {statistics.mean(f for f, _ in found):.0%} of "
                          f"rounds, {statistics.mean(t for _, t in found):.2f} tokens a round among them (width 4)")
            rate = {name: sum(t for *_, t in r) / sum(s for _, s, _ in r) for name, r in rounds.items()}
            step = statistics.median(s for _, s, _ in rounds["AR"])
            print(f"{suite}, run {rep + 1}: " + ", ".join(f"{name} {r:.1f} tokens/s ({r / rate['AR']:.3f}x AR)"
                                                           for name, r in rate.items()))
            for name in list(runtimes)[1:]:
                kinds = defaultdict(list)
                for kind, s, t in rounds[name]:
                    kinds[kind].append((s, t))
                print(f"  {name}: " + "; ".join(
                    f"{kind}: {len(r)} rounds x {statistics.median(s for s, _ in r) / step:.2f} AR steps, "
                    f"{statistics.mean(t for _, t in r):.2f} tokens" for kind, r in sorted(kinds.items())))


if __name__ == "__main__":
    main()
