"""Greedy tau against training data size: a table, a log-linear fit per suite, and a plot.

Input: `eval-tau --json` files of drafters trained with one recipe on the first N sequences of one
regen run, given as N=FILE. A paired reference drafter (--base FILE) adds per-prompt differences.
The fit is tau = a + b * log2(N) per suite (the shape seen for drafters below saturation); the
sequences a goal needs are read off it, an extrapolation that holds only while the curve stays
log-linear.

    python bench/learning_curve.py 208=runs/c1/curve/n208.tau.json 416=... \\
        --goals code=2.5 math=3.0 chat=2.5 --json docs/data/learning_curve.json --plot docs/learning_curve.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def paired(a: dict, b: dict) -> tuple[float, float]:
    """Mean and standard error of per-prompt differences b - a."""
    d = [y - x for x, y in zip(a["per_prompt_tau"], b["per_prompt_tau"], strict=True)]
    m = sum(d) / len(d)
    return m, math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("points", nargs="+", metavar="N=FILE")
    p.add_argument("--goals", nargs="*", default=[], metavar="SUITE=TAU")
    p.add_argument("--base", help="eval-tau JSON of a reference drafter, paired per prompt")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    points = sorted((int(n), json.loads(Path(f).read_text())["suites"]) for n, f in (s.split("=") for s in args.points))
    goals = {s: float(t) for s, t in (g.split("=") for g in args.goals)}
    base = json.loads(Path(args.base).read_text())["suites"] if args.base else None
    suites = list(points[0][1])
    out = {"points": [], "fits": {}}
    print("| sequences | " + " | ".join(suites) + " |\n|---|" + "---|" * len(suites))
    for n, res in points:
        cells = []
        for s in suites:
            cell = f"{res[s]['tau']:.3f} +- {res[s]['tau_se']:.3f}"
            if base:
                d, se = paired(base[s], res[s])
                cell += f" ({d:+.3f} +- {se:.3f})"
            cells.append(cell)
        print(f"| {n} | " + " | ".join(cells) + " |")
        out["points"].append({"sequences": n,
                              **{s: {"tau": res[s]["tau"], "tau_se": res[s]["tau_se"]} for s in suites}})
    for s in suites if len(points) > 1 else ():
        a, b = fit([math.log2(n) for n, _ in points], [res[s]["tau"] for _, res in points])
        need = 2 ** ((goals[s] - a) / b) if s in goals and b > 0 else None
        out["fits"][s] = {"a": a, "b_per_doubling": b, "goal": goals.get(s), "sequences_for_goal": need}
        print(f"{s}: tau = {a:.3f} + {b:.3f} log2(N)" + (f"; goal {goals[s]} at N = {need:,.0f}" if need else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.plot and len(points) > 1:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ns = [n for n, _ in points]
        for s in suites:
            line = ax.errorbar(ns, [r[s]["tau"] for _, r in points], yerr=[2 * r[s]["tau_se"] for _, r in points],
                               marker="o", capsize=3, label=s)
            f = out["fits"][s]
            grid = [ns[0] * 2 ** (k / 4) for k in range(0, 4 * int(math.log2(ns[-1] / ns[0]) + 3) + 1)]
            ax.plot(grid, [f["a"] + f["b_per_doubling"] * math.log2(x) for x in grid], ":", color=line[0].get_color())
            if s in goals:
                ax.axhline(goals[s], color=line[0].get_color(), alpha=0.3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training sequences (regenerated, ~230 tokens each)")
        ax.set_ylabel("greedy tau (40 held-out prompts, +-2 s.e.)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
