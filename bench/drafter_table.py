"""The DFlash vs DFlow table of docs/RESULTS.md: tau on every held-out suite, greedy and T = 1.

Rows: DFlash, DFlow, DFlow with its relay off (DFlash's own figures when DFlow's shared weights are
DFlash's: a relay trained alone on top of it). Per-prompt differences are paired (the same prompts and,
at T = 1, the same per-prompt seeds, hence the same text; see dflow_rt/eval/tau.py), reported as
mean +- standard error. Also the relay diagnostics of dflow_rt/eval/diagnose.py (greedy).

    python bench/drafter_table.py --dflash dflow_rt/assets/dflash --dflow dflow_rt/assets/dflow \
        --limit 60 --threads 1 --json table.json

(docs/data/drafter_table_bundled_60_prompts.json is this command's output for the bundled pair, run as
two processes and merged; docs/data/README.md lists every table and its command.)

With `--training-prompts-from 6000` the same table on prompts of the drafters' training generators that
no regen run used (suites train-code, train-math, train-chat): does a gain carry over to held-out suites?
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflow_rt.data.prompts import KINDS, SUITES, suite_prompts, training_prompt
from dflow_rt.eval.diagnose import relay_diagnostics
from dflow_rt.eval.tau import mean, measure_tau, sem
from dflow_rt.models.bundled import drafter_dir, target_dir
from dflow_rt.models.checkpoint import load_drafter, load_target
from dflow_rt.models.drafter import relay_off
from dflow_rt.tokenizer import load_tokenizer, stop_token_ids

ROWS = (("DFlash", "dflash", True), ("DFlow", "dflow", True), ("DFlow, relay off", "dflow", False))
PAIRS = (("DFlow - DFlash", "DFlow", "DFlash"), ("relay on - off", "DFlow", "DFlow, relay off"))


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    diff = [x - y for x, y in zip(a, b, strict=True)]
    return mean(diff), sem(diff)


def same_base(dflash, dflow) -> bool:
    """Whether the DFlow drafter's shared weights are the DFlash drafter's (a relay trained alone on top of
    it): then "DFlow, relay off" decodes exactly as DFlash and is not measured twice."""
    a, b = dflash.state_dict(), {k: v for k, v in dflow.state_dict().items() if not k.startswith("relay.")}
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def training_kind_prompts(tokenizer, kind: str, first: int, limit: int) -> list[list[int]]:
    """`limit` prompts of one kind from the drafters' training generator (`train regen`, seed 0), from prompt
    index `first` on: unseen by training when `first` is past every regen run's last index. The chat and
    math generators draw from finite pools, so a prompt's text may still repeat a trained one."""
    out, index = [], first
    while len(out) < limit:
        k, ids = training_prompt(tokenizer, 0, index, 128)
        out += [ids] if KINDS[k] == kind else []
        index += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--dflash", default="dflash")
    p.add_argument("--dflow", default="dflow")
    p.add_argument("--suites", nargs="+", default=list(SUITES))
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--limit", type=int, default=60)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--diagnostic-prompts", type=int, default=20,
                   help="per suite, greedy batch-1 rounds; 0 skips the diagnostics [20]")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda [cpu]")
    p.add_argument("--batch", type=int, default=8, help="prompts decoded together [8]")
    p.add_argument("--json", default=None)
    p.add_argument("--full-vocab", action="store_true",
                   help="draft over the whole vocabulary even where a drafter has a draft_vocab.json")
    p.add_argument("--training-prompts-from", type=int, default=None, metavar="INDEX",
                   help="measure on the training generator's prompts from INDEX on (suites train-code, ...), "
                        "not on the held-out suites: does a gain carry over from the training distribution?")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tdir = target_dir(args.target)
    target, tokenizer = load_target(tdir, device=args.device), load_tokenizer(tdir)
    drafters = {name: load_drafter(drafter_dir(spec, args.target), target, draft_vocab=not args.full_vocab)
                for name, spec in (("dflash", args.dflash), ("dflow", args.dflow))}
    stops = tuple(stop_token_ids(tokenizer))
    shared = same_base(*drafters.values())
    report = {"date": time.strftime("%Y-%m-%d"), "args": vars(args), "dflow_base_is_dflash": shared, "tau": {},
              "paired": {}, "diagnostics": {}}
    t0 = time.perf_counter()

    def save() -> None:  # after every row: a run cut short (a device's time limit) keeps what it measured
        report["seconds"] = round(time.perf_counter() - t0, 1)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    for suite in args.suites:
        if args.training_prompts_from is None:
            prompts = suite_prompts(tokenizer, suite, args.limit)
        else:
            prompts = training_kind_prompts(tokenizer, suite, args.training_prompts_from, args.limit)
            suite = f"train-{suite}"
        for T in args.temperatures:
            key = f"{suite} T={T:g}"
            per = {}
            for row, name, relay in ROWS:
                if row == "DFlow, relay off" and shared:
                    per[row], report["tau"][key][row] = per["DFlash"], report["tau"][key]["DFlash"]
                else:
                    with relay_off(drafters[name], not relay):
                        r = measure_tau(target, drafters[name], prompts, suite, T, args.max_new_tokens, stops,
                                        args.batch, progress=True)
                    per[row] = r.per_prompt
                    report["tau"].setdefault(key, {})[row] = r.summary()
                    print(f"{key:12s} {row:18s} tau {r.tau:.3f} +- {sem(r.per_prompt):.3f}  "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
                report["paired"][key] = {label: paired(per[a], per[b]) for label, a, b in PAIRS
                                         if a in per and b in per}
                save()
        for name in ("dflash", "dflow") if args.diagnostic_prompts > 0 else ():
            report["diagnostics"].setdefault(suite, {})[name] = relay_diagnostics(
                target, drafters[name], prompts[:args.diagnostic_prompts], args.max_new_tokens, stops)
            save()
            print(suite, name, json.dumps(report["diagnostics"][suite][name]), flush=True)
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = ["| suite | T | prompts | DFlash | DFlow | DFlow, relay off | DFlow - DFlash | relay on - off |",
             "|---|---|---|---|---|---|---|---|"]
    for key, rows in report["tau"].items():
        suite, T = key.split(" T=")
        cells = [f"{rows[r]['tau']:.3f} +- {rows[r]['tau_se']:.3f}" for r, _, _ in ROWS]
        diffs = [f"{m:+.3f} +- {s:.3f}" for m, s in report["paired"][key].values()]
        lines.append(f"| {suite} | {T} | {rows['DFlash']['prompts']} | " + " | ".join(cells + diffs) + " |")
    if report.get("dflow_base_is_dflash"):
        lines.append("\nDFlow's shared weights are DFlash's (its relay trained alone): relay off = DFlash exactly.")
    if not report["diagnostics"]:
        return "\n".join(lines)
    lines += ["", "| suite | drafter | rounds after a rejection | target right at rejected position | "
              "drafter slot 1 right | relay changes a round | relay changes a relayed slot |",
              "|---|---|---|---|---|---|---|"]
    for suite, per in report["diagnostics"].items():
        for name, d in per.items():
            lines.append(f"| {suite} | {name} | {d['rounds_after_rejection']} | {d['target_acc_at_rejected']:.3f} | "
                         f"{d['drafter_slot1_acc']:.3f} | {d.get('relay_changes_round', float('nan')):.3f} | "
                         f"{d.get('relay_changes_slot', float('nan')):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
