"""How fast batch-1 products stream their weights on CPU: eager, compiled with the weights frozen
(the GEMM library's prepacked kernel), and frozen with inductor's C++ GEMM templates autotuned
against the library, next to a plain read of the same bytes.

    python bench/cpu_gemv.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor
from torch import nn


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
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n_out, n_in = args.shape
    model = nn.ModuleList(nn.Linear(n_in, n_out, bias=False) for _ in range(args.products)).eval()
    x = torch.randn(1, n_in)
    gb = args.products * n_out * n_in * 4 / 1e9
    flat = torch.cat([m.weight.flatten() for m in model])

    def forward(x):
        return [m(x) for m in model]

    rows = {"read (sum)": timed(lambda _: flat.sum(), x, args.repeats)}
    with torch.no_grad():
        rows["eager"] = timed(forward, x, args.repeats)
        for name, patch in (("frozen", {}), ("frozen + C++ templates",
                                             {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"})):
            torch._dynamo.reset()
            with inductor.patch({"freezing": True, **patch}):
                compiled = torch.compile(forward)
                rows[name] = timed(compiled, x, args.repeats)
    for name, s in rows.items():
        print(f"{name}: {s * 1e3:.2f} ms, {gb / s:.1f} GB/s")


if __name__ == "__main__":
    main()
