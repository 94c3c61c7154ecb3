"""The fallback's choice on simulated noisy rounds: decode rate against always and never drafting.

Each case is a drafter and a round cost: a drafted round at verify width k emits 1 + (each of its
k - 1 drafts accepted with probability p; the text can change p halfway) tokens and costs `ratio`
plain steps; every round's time has lognormal jitter and a few rounds take twice as long, as on a
shared CPU. The policy (`dflow_rt.fallback.ArFallback`, or any file defining one, given with
--baseline for a side-by-side) sees only those timings and token counts, as in the Runtime. Figures
are simulated tokens/s, means over seeds; "best" is the better of always and never drafting.

    python bench/fallback_sim.py [--baseline OLD_FALLBACK.py] [--seeds 6] [--rounds 4000]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys

from dflow_rt.fallback import ArFallback

PLAIN_S = 0.025  # a plain step's time; only ratios matter
# name, k, acceptance p (first half, second half), drafted round cost in plain steps
CASES = [("k = 2, drafting pays 9 %", 2, (0.31, 0.31), 1.2),
         ("k = 2, drafting pays 21 %", 2, (0.5, 0.5), 1.24),
         ("k = 2, drafting loses 7 %", 2, (0.15, 0.15), 1.24),
         ("k = 4, tau 2.3", 4, (0.43, 0.43), 1.38),
         ("k = 4, tau 1.46", 4, (0.153, 0.153), 1.38),
         ("k = 2, pays, then loses", 2, (0.5, 0.05), 1.24),
         ("k = 2, loses, then pays", 2, (0.05, 0.5), 1.24)]


def simulate(policy, k: int, accept: tuple[float, float], ratio: float, rounds: int, seed: int,
             jitter: float = 0.08, slow: float = 0.02) -> float:
    """Tokens/s of `policy` (None: always draft, False: never) over `rounds` simulated rounds."""
    rnd = random.Random(seed)
    seconds = tokens = 0.0
    for i in range(rounds):
        drafted = True if policy is None else False if policy is False else policy.drafted(1)
        s = PLAIN_S * (ratio if drafted else 1.0) * rnd.lognormvariate(0, jitter)
        s *= 2.0 if rnd.random() < slow else 1.0
        p = accept[0] if i < rounds // 2 else accept[1]
        n = 1 + sum(rnd.random() < p for _ in range(k - 1)) if drafted else 1
        if policy not in (None, False):
            policy.record(1, drafted, s, float(n))
        seconds, tokens = seconds + s, tokens + n
    return tokens / seconds


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("baseline_fallback", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.ArFallback


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default=None, help="a fallback.py to compare with (e.g. from `git show`)")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--rounds", type=int, default=4000)
    args = p.parse_args()
    policies = {"policy": ArFallback, **({"baseline": load_baseline(args.baseline)} if args.baseline else {})}
    print("| case | always draft | never | " + " | ".join(policies) + " | policy / best |")
    print("|---|---|---|" + "---|" * len(policies) + "---|")
    for name, *case in CASES:
        def mean(make, case=case):
            return statistics.mean(simulate(make(), *case, args.rounds, seed) for seed in range(args.seeds))
        always, never = mean(lambda: None), mean(lambda: False)
        rates = {label: mean(cls) for label, cls in policies.items()}
        cells = " | ".join(f"{r:.1f}" for r in rates.values())
        print(f"| {name} | {always:.1f} | {never:.1f} | {cells} | {rates['policy'] / max(always, never):.3f} |")


if __name__ == "__main__":
    main()
