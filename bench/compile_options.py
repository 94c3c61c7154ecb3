"""Decode speed of compiled rounds per compile option, each Runtime in its own process (one process
would reuse the first graph it compiled), timed with other jobs of this machine paused.

    python bench/compile_options.py --target smollm2 --options freeze=0 freeze=1 --repeats 2 \
        --pause PID [PID ...] --json out.json

Each option builds a `Runtime(mode="compile")` at batch 1 (AR and the bundled DFlash drafter at
verify width 4), then decodes `--tokens` greedy tokens for each of four fixed chat prompts; the
figure is tokens/s over the decode (prefill excluded). Options run A B A B so drift cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

PROMPTS = ("Write a Python function that checks whether a number is prime.", "What is a Python list?",
           "Explain what a hash table is.", "Tom has 12 apples and gives 5 away. How many are left?")


def child(args) -> dict:
    import torch

    import dflow_rt
    from dflow_rt.data.prompts import chat_text
    from dflow_rt.models.bundled import load_models

    opts = {k: bool(int(v)) for k, v in (o.split("=") for o in args.option.split(","))} if args.option else {}
    target, drafter, tok = load_models(args.target, args.drafter, threads=args.threads)
    t0 = time.perf_counter()
    rt = dflow_rt.Runtime(target, drafter, dflow_rt.RuntimeConfig(
        mode="compile", max_batch=1, max_len=1024, verify_width=4 if drafter else None, **opts))
    build = time.perf_counter() - t0
    prompts = [tok.encode(chat_text(tok, p), add_special_tokens=False) for p in PROMPTS]
    rt.generate([prompts[0]], max_new_tokens=8)  # warm
    for pid in args.pause:
        os.kill(pid, signal.SIGSTOP)
    try:
        spent, tokens, rounds = 0.0, 0, 0
        with torch.inference_mode():
            for p in prompts:
                rid = rt.add_request(p, max_new_tokens=args.tokens)
                rt.step()  # prefill + first round, not timed
                first = len(rt.requests[rid].emitted)
                t = time.perf_counter()
                while not rt.is_finished(rid):
                    rt.step()
                spent += time.perf_counter() - t
                req = rt.pop(rid)
                tokens += len(req.emitted) - first
                rounds += len(req.acceptance) - 1
    finally:
        for pid in args.pause:
            os.kill(pid, signal.SIGCONT)
    return {"option": args.option, "drafter": args.drafter, "build_s": round(build, 1),
            "tokens_per_s": round(tokens / spent, 2), "tau": round(tokens / max(rounds, 1), 3),
            "cache_hit": getattr(rt, "compile_cache_hit", None)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafters", nargs="+", default=["none", "dflash"])
    p.add_argument("--options", nargs="+", default=["freeze=0", "freeze=1"], help="comma-joined RuntimeConfig flags")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pause", type=int, nargs="*", default=[], help="PIDs stopped while timing")
    p.add_argument("--json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--option", default="", help=argparse.SUPPRESS)
    p.add_argument("--drafter", default="none", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = []
    for _ in range(args.repeats):
        for drafter in args.drafters:
            for option in args.options:
                cmd = [sys.executable, __file__, "--child", "--option", option, "--drafter", drafter, "--target",
                       args.target, "--tokens", str(args.tokens), "--threads", str(args.threads),
                       "--pause", *map(str, args.pause)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    sys.exit(out.stderr[-2000:])
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(rows[-1], flush=True)
    from dflow_rt.engine.tuned import cpu_model

    result = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "threads": args.threads, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
