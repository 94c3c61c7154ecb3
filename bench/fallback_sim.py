"""The fallback's choice of verify width on simulated noisy rounds, against every fixed width.

Each case is a drafter and round costs: a round drafts a block whose drafts are each accepted with
probability p once the ones before them were, so a round at width w emits 1 plus the accepted drafts
among its first w - 1, and costs `cost[w]` plain steps (width 1 is the target stepping alone). A
case's rounds fall into equal stretches of text, one p each; in the "requests" cases each stretch is
a new request, which the policy hears of through `admitted` where it has that method, as from the
Runtime. Every round's time has lognormal jitter and a few rounds take twice as long, as on a shared
CPU. The policy (`dflow_rt.engine.policy.RoundPolicy`, or any file defining one, given with --baseline for
a side-by-side) sees only those timings and token counts, as in the Runtime.
Figures are simulated tokens/s, means over seeds; "best" is the best fixed width.

    python bench/fallback_sim.py [--baseline OLD_FALLBACK.py] [--seeds 6] [--rounds 4000]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys

from dflow_rt.engine.policy import RoundPolicy

PLAIN_S = 0.025  # a plain step's time; only ratios matter
K2 = {1: 1.0, 2: 1.24}  # round cost in plain steps per width: compiled SmolLM2 rounds on a 2-core AVX2 CPU
K4 = {1: 1.0, 2: 1.24, 4: 1.38}
AVX2 = {1: 1.0, 2: 1.37, 4: 1.82}  # the same with exact codes and 4-row tiles on a Zen 2 EPYC (docs/RESULTS.md)
# name, cost per width (the widths the bucket has), acceptance p of each equal stretch of text
CASES = [("k = 2, drafting pays 9 %", {1: 1.0, 2: 1.2}, (0.31, 0.31)),
         ("k = 2, drafting pays 21 %", K2, (0.5, 0.5)),
         ("k = 2, drafting loses 7 %", K2, (0.15, 0.15)),
         ("k = 2, pays, then loses", K2, (0.5, 0.05)),
         ("k = 2, loses, then pays", K2, (0.05, 0.5)),
         ("k = 4 of 1/2/4, p 0.55 (4 best)", K4, (0.55, 0.55)),
         ("k = 4 of 1/2/4, p 0.45 (2 and 4 close)", K4, (0.45, 0.45)),
         ("k = 4 of 1/2/4, p 0.3 (2 best)", K4, (0.3, 0.3)),
         ("k = 4 of 1/2/4, p 0.12 (1 best)", K4, (0.12, 0.12)),
         ("k = 4 of 1/2/4, p 0.6, then 0.1", K4, (0.6, 0.1)),
         ("k = 4 of 1/2/4, p 0.1, then 0.6", K4, (0.1, 0.6)),
         ("k = 4, AVX2 code costs, p 0.3 (1 best)", AVX2, (0.3, 0.3)),
         ("k = 4, AVX2 code costs, p 0.45 (2 best by 4 %)", AVX2, (0.45, 0.45)),
         ("k = 4, AVX2 code costs, p 0.6 (4 best)", AVX2, (0.6, 0.6))]
ZEN4 = {1: 1.0, 2: 1.3, 4: 2.0}  # exact codes on a Zen 4 EPYC, 2 threads (docs/RESULTS.md)
# requests: one stretch each; the first long one where drafting loses, then short ones where it pays, ...
REQUEST_CASES = [("requests: 1 losing (p 0.05) x 8 long, then 16 paying (p 0.6)", ZEN4, (0.05,) * 8 + (0.6,) * 16),
                 ("requests: losing (p 0.1) and paying (p 0.6) alternate", ZEN4, (0.1, 0.6) * 12),
                 ("requests: all losing (p 0.1)", ZEN4, (0.1,) * 24),
                 ("requests: all losing (p 0.2)", ZEN4, (0.2,) * 24),
                 ("requests: all paying (p 0.6)", ZEN4, (0.6,) * 24)]


def simulate(policy, cost: dict[int, float], accept: tuple[float, ...], rounds: int, seed: int,
             jitter: float = 0.08, slow: float = 0.02, requests: bool = False) -> float:
    """Tokens/s of `policy` (an int: that width every round) over `rounds` simulated rounds."""
    rnd, widest = random.Random(seed), max(cost)
    seconds = tokens = 0.0
    for i in range(rounds):
        stretch = i * len(accept) // rounds
        if requests and i and stretch != (i - 1) * len(accept) // rounds and hasattr(policy, "admitted"):
            policy.admitted()
        w = policy if isinstance(policy, int) else policy.width(1)
        s = PLAIN_S * cost[w] * rnd.lognormvariate(0, jitter) * (2.0 if rnd.random() < slow else 1.0)
        p = accept[stretch]
        accepted = 0
        while accepted < widest - 1 and rnd.random() < p:  # the same block whatever the width
            accepted += 1
        n = 1 + min(accepted, w - 1)
        if not isinstance(policy, int):
            policy.record(1, w, s, [n])
        seconds, tokens = seconds + s, tokens + n
    return tokens / seconds


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("baseline_fallback", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.RoundPolicy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default=None, help="a fallback.py to compare with (e.g. from `git show`)")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--rounds", type=int, default=4000)
    args = p.parse_args()
    policies = {"policy": RoundPolicy, **({"baseline": load_baseline(args.baseline)} if args.baseline else {})}
    print("| case | fixed widths | " + " | ".join(policies) + " | policy / best |")
    print("|---|---|" + "---|" * len(policies) + "---|")
    for name, cost, accept, requests in [(*c, False) for c in CASES] + [(*c, True) for c in REQUEST_CASES]:
        def mean(make, cost=cost, accept=accept, requests=requests):
            return statistics.mean(simulate(make(), cost, accept, args.rounds, seed, requests=requests)
                                   for seed in range(args.seeds))
        fixed = {w: mean(lambda w=w: w) for w in cost}
        rates = {label: mean(lambda cls=cls, cost=cost: cls({1: tuple(cost)})) for label, cls in policies.items()}
        widths = ", ".join(f"{w}: {r:.1f}" for w, r in fixed.items())
        cells = " | ".join(f"{r:.1f}" for r in rates.values())
        print(f"| {name} | {widths} | {cells} | {rates['policy'] / max(fixed.values()):.3f} |")


if __name__ == "__main__":
    main()
