"""Peak resident memory of a CPU Runtime: load the models, build a Runtime, generate, each run in a
fresh process (its own `ru_maxrss`), with the RSS after each phase.

    python bench/peak_rss.py --target smollm2 --drafter dflash --max-len 1024 --new 32 --runs 2

The process's peak includes Python, torch and the C++ kernel library (about 300 MB before any model).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 1e6


def child(args: argparse.Namespace) -> None:
    if args.without_triton:  # as a plain install has it: torch's CPU wheel brings no triton (the test extra does)
        sys.modules["triton"] = None
    import torch

    from dflow_rt.config import RuntimeConfig
    from dflow_rt.engine.runtime import Runtime
    from dflow_rt.kernels.cpu import ops as cpu_ops
    from dflow_rt.models.bundled import load_models

    cpu_ops.enabled()  # the kernel library is part of every Runtime's process: loaded before the first figure
    phases = {"start": _rss_mb()}
    target, drafter, tok = load_models(args.target, None if args.drafter == "none" else args.drafter, "cpu",
                                       args.threads)
    phases["loaded"] = _rss_mb()
    config = RuntimeConfig(mode=args.mode, max_batch=1, max_len=args.max_len)
    rt = Runtime(target, drafter, config)
    phases["runtime"] = _rss_mb()
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Tell me a story about it:")
    out = rt.generate([ids], max_new_tokens=args.new)[0]
    phases["generated"] = _rss_mb()
    f32 = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for m in (target, drafter)
               if m is not None for p in m.parameters() if p.dtype == torch.float32}.values())  # each storage once
    print(json.dumps({"phases": phases, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
                      "float32_parameter_bytes": f32, "tokens": out}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="dflash")
    p.add_argument("--mode", default="eager")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--new", type=int, default=32, help="tokens to generate")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--runs", type=int, default=2, help="fresh processes")
    p.add_argument("--without-triton", action="store_true",
                   help="hide triton, as a plain install has none (torch's dynamo imports it when installed: ~67 MB)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    results = []
    for _ in range(args.runs):
        cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for r in results:
        phases = ", ".join(f"{k} {v:.0f}" for k, v in r["phases"].items())
        print(f"peak {r['peak']:.0f} MB (RSS after each phase, MB: {phases}); float32 parameters "
              f"{r['float32_parameter_bytes'] / 1e6:.0f} MB")
    print(f"peak RSS median {statistics.median(r['peak'] for r in results):.0f} MB over {len(results)} processes; "
          f"tokens identical across runs: {all(r['tokens'] == results[0]['tokens'] for r in results)}")
    print("tokens:", results[0]["tokens"])


if __name__ == "__main__":
    main()
