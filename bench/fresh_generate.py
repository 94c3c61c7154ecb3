"""`dflow-rt generate` with a drafter against `--drafter none`, each answer in a fresh process, as a user
meets it.

Every prompt runs once per arm and temperature, each a new `dflow-rt generate` process with no flag
beyond the model, the sampling, the length and the arm's own flags: the defaults under test, with the
compile cache and the fallback's kept timings as a later start finds them. The arms' order rotates
from prompt to prompt (drift on a busy machine cancels). Every arm gets the same seed, so their tokens
must agree (lossless); a difference stops the run.

    python bench/fresh_generate.py --target smollm2 --suites code mt-bench champ --prompts 8 \\
        --max-new-tokens 64 --temperatures 0 1 --threads 2 \\
        --arm dflash="--drafter dflash" --arm fresh="--drafter dflash --no-keep-timings" --json out.json

Per suite and temperature, each arm's decode tokens/s (tokens after the first step over their
seconds, summed over prompts) and its ratio to `--drafter none`, with the geometric mean of the
per-prompt ratios and its standard error (of the mean log ratio, as a percentage): the run's
noise. `--forget-timings` empties the fallback's kept timings first, so the first drafted
process learns from nothing, as on a new machine.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import time

from dflow_rt.data.prompts import SUITES, suite_texts


def run(args: argparse.Namespace, flags: list[str], prompt: str, chat: bool, temperature: float, seed: int) -> dict:
    cmd = [sys.executable, "-m", "dflow_rt", "generate", "--target", args.target, "--prompt", prompt,
           "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(temperature), "--seed", str(seed),
           "--json", *flags] + (["--threads", str(args.threads)] if args.threads else []) + (["--chat"] if chat else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(flags)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=FLAGS",
                   help="a drafted arm: its name and its `generate` flags [dflash=\"--drafter dflash\"]")
    p.add_argument("--suites", nargs="+", default=["code", "mt-bench", "champ"], choices=SUITES)
    p.add_argument("--prompts", type=int, default=8, help="first N prompts of each suite [8]")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--forget-timings", action="store_true", help="empty the fallback's kept timings first")
    p.add_argument("--json", default=None, help="also write every process's figures here")
    args = p.parse_args()
    arms = {"none": ["--drafter", "none"]}
    for spec in args.arm or ["dflash=--drafter dflash"]:
        name, _, flags = spec.partition("=")
        arms[name] = flags.split()
    if args.forget_timings:
        from dflow_rt.engine.policy import TimingsFile

        shutil.rmtree(TimingsFile.directory(), ignore_errors=True)
    report = {"command": " ".join(sys.argv), "cpu": cpu_name(), "arms": arms,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": [], "rows": []}
    names = list(arms)
    for suite in args.suites:
        prompts = suite_texts(suite, args.prompts, chat=lambda q: q)  # questions: `generate --chat` wraps them
        for temperature in args.temperatures:
            made: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
            ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
            for i, prompt in enumerate(prompts):
                order = names[i % len(names):] + names[:i % len(names)]
                got = {name: run(args, arms[name], prompt, suite != "code", temperature, 1000 + i) for name in order}
                for name, r in got.items():
                    if r["token_ids"] != got["none"]["token_ids"]:
                        raise SystemExit(f"{suite} prompt {i} at temperature {temperature}: {name}'s tokens differ")
                    made[name].append((len(r["token_ids"]) - 1, r["decode_s"]))  # the first comes with prefill
                    report["runs"].append({"suite": suite, "prompt": i, "temperature": temperature, "arm": name,
                                           **{k: r[k] for k in ("tokens_per_s", "tau", "rounds", "plain_steps",
                                                                "lookup_rounds", "lookup_tokens", "decode_s",
                                                                "setup_s")}})
                    if name != "none":
                        ratios[name].append(r["tokens_per_s"] / got["none"]["tokens_per_s"])
            rate = {name: sum(n for n, _ in v) / sum(s for _, s in v) for name, v in made.items()}
            row = {"suite": suite, "temperature": temperature, "none_tokens_per_s": round(rate["none"], 1)}
            for name in names[1:]:
                logs = [math.log(r) for r in ratios[name]]
                mean = sum(logs) / len(logs)
                se = math.sqrt(sum((x - mean) ** 2 for x in logs) / max(len(logs) - 1, 1) / len(logs))
                row[name] = {"tokens_per_s": round(rate[name], 1), "ratio": round(rate[name] / rate["none"], 3),
                             "geomean_ratio": round(math.exp(mean), 3), "log_ratio_se": round(se, 3)}
            report["rows"].append(row)
            print(f"{suite} T={temperature:g}: none {row['none_tokens_per_s']} tokens/s; " + "; ".join(
                f"{name} {row[name]['tokens_per_s']} ({row[name]['ratio']:.3f}x, per-prompt geomean "
                f"{row[name]['geomean_ratio']:.3f}x +- {100 * row[name]['log_ratio_se']:.1f} %)"
                for name in names[1:]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
