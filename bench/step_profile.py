"""Where a compiled batch-1 step's time goes: `torch.profiler` over steps of the Runtime's own rounds
(AR by default, or a DFlash round at a verify width), self CPU time per op a step, largest first.
`--mode eager` profiles the eager rounds instead, where the Python between ops shows as the gap
between the steps' wall time and their ops' self time.

    python bench/step_profile.py --target smollm2 --threads 2 [--drafter dflash --verify-width 4] [--mode eager]
"""

from __future__ import annotations

import argparse

import torch
from round_cost import SIZES  # bench/ is on the path when run as a script
from torch.profiler import ProfilerActivity, profile

from dflow_rt.config import RuntimeConfig
from dflow_rt.data.prompts import suite_prompts
from dflow_rt.engine.runtime import Runtime
from dflow_rt.models.bundled import load_models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="none")
    p.add_argument("--verify-width", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=25, help="ops shown")
    p.add_argument("--mode", choices=("compile", "eager"), default="compile")
    p.add_argument("--shapes", action="store_true", help="one line per op and input shapes")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    drafted = args.drafter != "none"
    target, drafter, tokenizer = load_models(args.target, args.drafter if drafted else None, "cpu",
                                             args.threads, True, None)
    rt = Runtime(target, drafter, RuntimeConfig(**SIZES, mode=args.mode,
                                                verify_width=args.verify_width if drafted else None))
    prompt = suite_prompts(tokenizer, "code", 1)[0]
    rid = rt.add_request(prompt, max_new_tokens=args.steps + 8)
    for _ in range(4):  # prefill and warm rounds
        rt.step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
        steps = 0
        while steps < args.steps and not rt.is_finished(rid):
            rt.step()
            steps += 1
    events = prof.key_averages(group_by_input_shape=args.shapes)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    print(f"{steps} {'rounds' if drafted else 'steps'}, {total:.2f} ms self CPU time each (all threads' ops)")
    for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.rows]:
        print(f"{e.self_cpu_time_total / steps / 1e3:7.2f} ms  {e.count / steps:6.1f} calls  {e.key[:90]}"
              + (f"  {e.input_shapes}" if args.shapes else ""))


if __name__ == "__main__":
    main()
