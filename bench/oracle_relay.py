"""The oracle-relay bound: what relayed states could buy a DFlow drafter at most.

A DFlow round relays the target's states at the rejected positions, computed behind the wrong drafts.
The oracle relay carries the states of the true continuation there instead (the target's clean pass
over the tokens it does write), everything else unchanged: the same relay weights, a, c and d. If
the oracle relay does not beat relay-off either, the relay cannot use even perfect states and the
fault is in the relay; if it does, the states the real round can relay are the limit.

Greedy, on the first --limit prompts of each held-out suite: the target's greedy continuation (a
drafter-less Runtime) fixes the sequence, then the training objective's rounds are unrolled on it
from the prompt's end, which are exactly the rounds `generate` runs (tests/test_train_drafter.py),
once per arm: relay off, relay on, oracle relay. Per-prompt tau is paired across arms.

    python bench/oracle_relay.py --target smollm2 --drafter dflow --limit 40 --max-new-tokens 64 \\
        --json docs/data/oracle_relay_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from dflow_rt.config import RuntimeConfig
from dflow_rt.data.prompts import SUITES, suite_prompts
from dflow_rt.engine.runtime import Runtime
from dflow_rt.models.bundled import load_models
from dflow_rt.models.drafter import relay_off
from dflow_rt.tokenizer import stop_token_ids
from dflow_rt.train.objective import DraftObjective

ARMS = ("relay_off", "relay_on", "oracle")


def continuations(target, prompts: list[list[int]], max_new_tokens: int, stops: tuple[int, ...]) -> list[list[int]]:
    """The target's greedy continuation of each prompt (autoregressive Runtime, batch 8)."""
    rt = Runtime(target, None, RuntimeConfig(max_batch=8, max_len=max(map(len, prompts)) + max_new_tokens + 1,
                                             mode="eager", tuned=False))
    rids = [rt.add_request(p, max_new_tokens=max_new_tokens, stop_token_ids=stops) for p in prompts]
    while not all(rt.is_finished(r) for r in rids):
        rt.step()
    return [list(rt.pop(r).emitted) for r in rids]


@torch.no_grad()
def rollout_tau(target, drafter, prompts: list[list[int]], conts: list[list[int]], arm: str) -> list[float]:
    """Per-prompt tau of the rounds unrolled on prompt + continuation, in batches of 8."""
    objective = DraftObjective(drafter, target, gamma=4.0, rounds=3, oracle_relay=arm == "oracle")
    out = []
    with relay_off(drafter, arm == "relay_off"):
        for k in range(0, len(prompts), 8):
            rows = [p + c for p, c in zip(prompts[k:k + 8], conts[k:k + 8], strict=True)]
            ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
            for j, r in enumerate(rows):
                ids[j, :len(r)] = torch.tensor(r)
            starts = torch.tensor([[len(p)] for p in prompts[k:k + 8]])
            trace = []
            objective(ids, torch.tensor([len(r) for r in rows]), starts, torch.ones_like(starts, dtype=torch.bool),
                      trace, rounds=10_000)
            emitted = sum((t["accepted"] + 1) * t["ok"] for t in trace)[:, 0]
            rounds = sum(t["ok"].long() for t in trace)[:, 0]
            out += (emitted / rounds.clamp(min=1)).tolist()
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="dflow", help="a DFlow drafter (name or directory)")
    p.add_argument("--limit", type=int, default=40, help="prompts per suite")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int)
    p.add_argument("--json", help="write the per-prompt figures here")
    args = p.parse_args()
    target, drafter, tokenizer = load_models(args.target, args.drafter, "cpu", args.threads, dtype="float32")
    if drafter is None or drafter.relay is None:
        raise SystemExit(f"--drafter {args.drafter}: needs a DFlow drafter (one with a relay)")
    stops = tuple(stop_token_ids(tokenizer))
    report = {"target": args.target, "drafter": args.drafter, "max_new_tokens": args.max_new_tokens, "suites": {}}
    print(f"{'suite':6} {'relay off':>15} {'relay on':>15} {'oracle':>15} {'on - off':>16} {'oracle - on':>16}")
    for suite in SUITES:
        t0 = time.perf_counter()
        prompts = suite_prompts(tokenizer, suite, args.limit)
        conts = continuations(target, prompts, args.max_new_tokens, stops)
        taus = {arm: rollout_tau(target, drafter, prompts, conts, arm) for arm in ARMS}
        diff = {name: mean_se([y - x for x, y in zip(taus[a], taus[b], strict=True)])
                for name, a, b in (("on_minus_off", "relay_off", "relay_on"), ("oracle_minus_on", "relay_on", "oracle"),
                                   ("oracle_minus_off", "relay_off", "oracle"))}
        report["suites"][suite] = {"prompts": len(prompts), **{a: mean_se(taus[a]) for a in ARMS}, **diff,
                                   "per_prompt_tau": taus, "seconds": round(time.perf_counter() - t0, 1)}
        cells = [f"{m:.3f} +- {s:.3f}" for m, s in (mean_se(taus[a]) for a in ARMS)]
        cells += [f"{m:+.3f} +- {s:.3f}" for m, s in (diff["on_minus_off"], diff["oracle_minus_on"])]
        print(f"{suite:6} " + " ".join(f"{c:>15}" for c in cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
