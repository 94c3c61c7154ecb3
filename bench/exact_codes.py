"""Products over exact codes against the float32 kernel on a real target's weights: how many bytes the
codes save, how long coding takes, and one decode step's products (every weight of the target once)
at a few row counts, the two kernels interleaved beside a plain read of the float32 bytes.

    python bench/exact_codes.py --target smollm2 --threads 2 --rows 1 2 4 8 --repeats 7
    python bench/exact_codes.py --target smollm2 --drafter dflash --rows 8   # the drafter's own weights

With --drafter, a pass covers the drafter's own products (not those it shares with the target), each
pass after a read of 256 MB that evicts them from the caches, as the target's pass does in a round.

Every coded product is first checked bit for bit against the float32 one (the codes' promise).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.models import exact_codes
from dflow_rt.models.bundled import load_models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default=None, help="time this drafter's own products instead of the target's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=7, help="interleaved passes over both kernels")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_ops.enabled(), "the CPU product kernel does not build or load here"
    target, drafter, _ = load_models(args.target, args.drafter, "cpu", args.threads, True, None)
    layers = list({id(m.weight): m for m in target.modules() if isinstance(m, cpu_ops.Linear)}.values())
    evict = None
    if drafter is not None:
        shared = {m.weight.data_ptr() for m in layers}
        layers = [m for m in drafter.modules() if isinstance(m, cpu_ops.Linear) and m.weight.data_ptr() not in shared]
        evict = torch.ones(64 << 20)
    t0 = time.perf_counter()
    codes = [exact_codes.encode(m.weight) for m in layers]
    seconds = time.perf_counter() - t0
    weights = [m.weight.detach() for m in layers]
    plain = sum(w.numel() * 4 for w in weights)
    coded = sum(c.codes.numel() if c is not None else w.numel() * 4 for w, c in zip(weights, codes, strict=True))
    kinds = [c.kind if c is not None else "float32" for c in codes]
    print(f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, torch {torch.__version__}; "
          f"{len(layers)} weights ({', '.join(f'{k} {kinds.count(k)}' for k in sorted(set(kinds)))}) coded in "
          f"{seconds:.1f} s: {plain / 1e6:.0f} MB of float32 read as {coded / 1e6:.0f} MB")
    for rows in args.rows:
        for w, c in zip(weights, codes, strict=True):
            x = torch.randn(rows, w.shape[1])
            assert torch.equal(cpu_ops.linear(x, w, codes=c), torch.ops.dflow_rt.gemv(x, w)), "codes changed a result"
    print("every coded product bit-identical to the float32 kernel's")
    flat = torch.cat([w.flatten() for w in weights])

    def step(xs: dict[int, torch.Tensor], use_codes: bool) -> None:
        for w, c in zip(weights, codes, strict=True):
            cpu_ops.linear(xs[w.shape[1]], w, codes=c if use_codes else None)

    def timed(fn, *fn_args) -> float:
        if evict is not None:
            evict.sum()
        t = time.perf_counter()
        fn(*fn_args)
        return time.perf_counter() - t

    with torch.no_grad():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
            step(xs, True), step(xs, False)  # warm
            runs: dict[str, list[float]] = {"read": [], "float32": [], "codes": []}
            for _ in range(args.repeats):
                runs["read"].append(timed(flat.sum))
                runs["float32"].append(timed(step, xs, False))
                runs["codes"].append(timed(step, xs, True))
            t = {k: statistics.median(v) for k, v in runs.items()}
            gbps = plain / t["read"] / 1e9
            print(f"rows {rows}: read of the float32 bytes {t['read'] * 1e3:.1f} ms ({gbps:.1f} GB/s); "
                  f"float32 {t['float32'] * 1e3:.1f} ms, codes {t['codes'] * 1e3:.1f} ms: "
                  f"{t['float32'] / t['codes']:.2f}x")


if __name__ == "__main__":
    main()
