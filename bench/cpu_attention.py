"""The CPU attention kernel (`dflow_rt/kernels/cpu/attention.cpp`) against SDPA over the dense mask (what
the `torch` attention runs), one decoder step's attention (every layer once) per query-row count and
context, at a target's attention shape, the two interleaved; results are checked close first.

    python bench/cpu_attention.py --target smollm2 --threads 2 --rows 1 2 4 16 --contexts 100 250 450

Rows 1 is a decode step, 2-4 a verify pass, 16 the drafter's bidirectional block (`--rows` above 1
are causal except 16). The cache view is the length bucket a Runtime would read (the context plus the
block, rounded up to 64), so SDPA computes and masks the rest of the bucket, as it does in a round.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from dflow_rt.kernels.attention import attention_torch, cache_mask
from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.models.bundled import load_models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[100, 250, 450])
    p.add_argument("--repeats", type=int, default=9, help="interleaved passes over both implementations")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_ops.enabled(), "the CPU kernels do not build or load here"
    target, _, _ = load_models(args.target, None, "cpu", args.threads, True, None)
    c = target.config
    layers, heads, kv_heads, d = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    print(f"{args.target}: {layers} layers, {heads} heads over {kv_heads} kv heads of {d}; "
          f"{args.threads} threads, instruction set {torch.backends.cpu.get_cpu_capability()}")
    print("| rows | context | bucket | SDPA, dense mask (ms) | kernel (ms) | speedup |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for context in args.contexts:
        for rows in args.rows:
            causal = rows != 16
            bucket = -(-(context + rows) // 64) * 64
            q = torch.randn(1, heads, rows, d, generator=g)
            k, v = (torch.randn(1, kv_heads, bucket + 1, d, generator=g)[:, :, :bucket] for _ in "kv")
            start = torch.tensor([context])
            mask = cache_mask(start[:, None] + torch.arange(rows), bucket, causal)[:, None]
            sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, enable_gqa=True)
            ours = functools.partial(torch.ops.dflow_rt.cache_attention, q, k, v, start, causal)
            torch.testing.assert_close(ours(), attention_torch(q, k, v, start, causal), atol=1e-5, rtol=1e-5)
            times = {"sdpa": [], "ours": []}
            for _ in range(args.repeats):
                for name, fn in (("sdpa", sdpa), ("ours", ours)):
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(layers):
                        fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
            a, b = statistics.median(times["sdpa"]), statistics.median(times["ours"])
            print(f"| {rows} | {context} | {bucket} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
