"""How fast products of a few rows stream their weights on CPU: torch's GEMM library (eager; frozen
and compiled, with and without inductor's C++ GEMM templates) and our kernel (`dflow_rt/models/
kernels/cpu/gemv.cpp`), next to a plain read of the same bytes. One thread by default; rows 1 is a decode
step, 2-16 a verify pass.

    python bench/cpu_gemv.py --threads 1 --rows 1 2 4 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor
import torch.nn.functional as F
from torch import nn

from dflow_rt.kernels.cpu import ops as cpu_ops


def timed(fn, x, repeats: int) -> float:
    for _ in range(3):
        fn(x)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--products", type=int, default=20)
    p.add_argument("--shape", type=int, nargs=2, default=[1536, 576], metavar=("OUT", "IN"))
    p.add_argument("--rows", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--frozen", action="store_true", help="also the frozen compiled rows (minutes of compiling)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n_out, n_in = args.shape
    model = nn.ModuleList(nn.Linear(n_in, n_out, bias=False) for _ in range(args.products)).eval()
    gb = args.products * n_out * n_in * 4 / 1e9
    flat = torch.cat([m.weight.flatten() for m in model])
    kernel = cpu_ops.enabled()

    def forward(x):
        return [F.linear(x, m.weight) for m in model]

    def ours(x):
        return [torch.ops.dflow_rt.gemv(x, m.weight) for m in model]

    print(f"read (sum): {gb / timed(lambda _: flat.sum(), None, args.repeats):.1f} GB/s")
    for rows in args.rows:
        x = torch.randn(rows, n_in)
        out = {}
        with torch.no_grad():
            out["eager"] = timed(forward, x, args.repeats)
            if kernel:
                out["ours"] = timed(ours, x, args.repeats)
            if args.frozen:
                for name, patch in (("frozen", {}), ("frozen + C++ templates",
                                                     {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"})):
                    torch._dynamo.reset()
                    with inductor.patch({"freezing": True, **patch}):
                        out[name] = timed(torch.compile(forward), x, args.repeats)
        print(f"rows {rows}: " + ", ".join(f"{name} {gb / s:.1f} GB/s" for name, s in out.items()))


if __name__ == "__main__":
    main()
