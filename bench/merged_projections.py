"""Would merging q/k/v and gate/up projections at load speed batch-1 decoding on CPU?

Times, interleaved, the 30 SmolLM2-shaped layers' q/k/v/gate/up products for one token as five
separate GEMVs per layer against two over concatenated weights (random float32 weights; the cost of
a GEMV at batch 1 is reading its weights, so the question is only whether fewer, larger reads stream
faster). Prints the medians and their ratio.

    python bench/merged_projections.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--kv", type=int, default=192)
    p.add_argument("--ffn", type=int, default=1536)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    h = args.hidden
    layers = []
    for _ in range(args.layers):
        q, k, v = torch.randn(h, h), torch.randn(args.kv, h), torch.randn(args.kv, h)
        g, u = torch.randn(args.ffn, h), torch.randn(args.ffn, h)
        layers.append(((q, k, v, g, u), (torch.cat([q, k, v]), torch.cat([g, u]))))
    x = torch.randn(1, h)

    def separate() -> None:
        for ws, _ in layers:
            for w in ws:
                F.linear(x, w)

    def merged() -> None:
        for _, ws in layers:
            for w in ws:
                F.linear(x, w)

    times = {"separate": [], "merged": []}
    for r in range(args.repeats):
        for name, f in ((("separate", separate), ("merged", merged))[::1 if r % 2 else -1]):
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = sum(w.numel() * 4 for _, ws in layers for w in ws) / 1e6
    for k, v in med.items():
        print(f"{k}: {v * 1e3:.2f} ms ({mb / 1e3 / v:.1f} GB/s over {mb:.0f} MB)")
    print(f"merged / separate: {med['merged'] / med['separate']:.3f}")


if __name__ == "__main__":
    main()
