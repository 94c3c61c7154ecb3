"""Two drafters of one target, paired on the held-out suites: the A/B table of a data or recipe experiment.

    python bench/drafter_ab.py --target smollm2 --a dflash --b runs/l1/dflash_sub3072 --limit 40 \
        --max-new-tokens 64 --threads 1 --json ab.json

Greedy tau per prompt through the Runtime (`dflow_rt.eval.tau`), both drafters over the whole
vocabulary (a draft vocabulary is a property of one drafter's data, not of its recipe); the
difference B - A is paired per prompt, mean +- standard error. A verdict line per suite says
whether B wins or loses by more than 2 standard errors.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflow_rt.data.prompts import SUITES, suite_prompts
from dflow_rt.engine.tuned import cpu_model
from dflow_rt.eval.tau import mean, measure_tau, sem
from dflow_rt.models.bundled import drafter_dir, target_dir
from dflow_rt.models.checkpoint import load_drafter, load_target
from dflow_rt.tokenizer import load_tokenizer, stop_token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--a", required=True, help="drafter A: dflash, dflow (bundled) or a directory")
    p.add_argument("--b", required=True, help="drafter B")
    p.add_argument("--suites", nargs="+", default=list(SUITES))
    p.add_argument("--limit", type=int, default=40, help="first N prompts of each suite [40]")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tdir = target_dir(args.target)
    target, tokenizer = load_target(tdir), load_tokenizer(tdir)
    stops = tuple(stop_token_ids(tokenizer))
    drafters = {k: load_drafter(drafter_dir(getattr(args, k), args.target), target, draft_vocab=False) for k in "ab"}
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "args": vars(args), "suites": {}}
    t0 = time.perf_counter()
    for suite in args.suites:
        prompts = suite_prompts(tokenizer, suite, args.limit)
        per = {k: measure_tau(target, d, prompts, suite, 0.0, args.max_new_tokens, stops, args.batch).per_prompt
               for k, d in drafters.items()}
        diff = [b - a for a, b in zip(per["a"], per["b"], strict=True)]
        d, se = mean(diff), sem(diff)
        verdict = "B wins" if d > 2 * se else "B loses" if d < -2 * se else "within 2 s.e."
        report["suites"][suite] = {"prompts": len(prompts), "tau_a": mean(per["a"]), "tau_a_se": sem(per["a"]),
                                   "tau_b": mean(per["b"]), "tau_b_se": sem(per["b"]), "b_minus_a": d,
                                   "b_minus_a_se": se, "verdict": verdict, "per_prompt": per}
        print(f"{suite}: A {mean(per['a']):.3f} +- {sem(per['a']):.3f} | B {mean(per['b']):.3f} +- "
              f"{sem(per['b']):.3f} | B - A {d:+.3f} +- {se:.3f} ({verdict}; {time.perf_counter() - t0:.0f} s)",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
