"""Tile shapes for the CPU product kernel (`dflow_rt/kernels/cpu/gemv.cpp`) on this machine's
instruction set: each variant is the kernel's source with another dispatch (a tile of rows of x by
rows of w per row count), built as a library of its own and timed on one SmolLM2 step's products
(random weights of its shapes) next to a read of the same bytes, variants interleaved.

    python bench/gemv_tiles.py --threads 2 --rows 1 2 4 8 --repeats 7 [--set prefetch] [--huge-pages]

Every variant sums each element in the kernel's one fixed order, so all must agree bit for bit with
the shipped kernel; the script checks that before it times anything.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.models import huge_pages

# (rows of x, rows of w) per row count: 1 row, 2-3 rows, 4 rows and more; then how many blocks of w
# ahead every tile prefetches (0: the hardware prefetcher alone). The first variant is the baseline.
VARIANTS = {
    "4x4": (((4, 4), (4, 4), (4, 4)), 1),
    "1x6 2x8 4x6": (((1, 6), (2, 8), (4, 6)), 1),
    "1x8 2x8 4x6": (((1, 8), (2, 8), (4, 6)), 1),
    "1x12 2x8 4x6": (((1, 12), (2, 8), (4, 6)), 1),
    "1x8 2x4 4x2": (((1, 8), (2, 4), (4, 2)), 1),
    "1x1 2x12 4x4": (((1, 1), (2, 12), (4, 4)), 1),
    "1x1 2x8 8x3": (((1, 1), (2, 8), (8, 3)), 1),
}
SHIPPED = ((1, 1), (2, 8), (4, 6))  # AVX-512; a single row of w (1x1) is never prefetched
SETS = {
    "tiles": VARIANTS,
    # the shipped tiles of 2 rows of x and more, prefetching 1 block ahead (as shipped), 0, 2 or 4
    "prefetch": {f"ahead {d}": (SHIPPED, d) for d in (1, 0, 2, 4)},
    # one row of x: fewer rows of w at once are fewer concurrent streams for the hardware prefetcher
    "one-row": {f"1x{n} ahead {d}": (((1, n), *SHIPPED[1:]), d)
                for n, d in ((8, 1), (8, 0), (1, 1), (1, 0), (2, 1), (4, 0), (16, 1))},
    # 4 rows of x and more (verify and draft passes): one row of w at a time is one sequential stream
    "many-rows": {f"{rx}x{rw} ahead {d}": ((*SHIPPED[:2], (rx, rw)), d)
                  for rx, rw, d in ((4, 6, 1), (4, 1, 0), (8, 1, 0), (4, 2, 0), (8, 2, 0), (4, 6, 0))},
}
# One SmolLM2-135M step: 30 layers of q, k, v, o, gate, up, down, then the head ([out, in]).
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
STEP = LAYER * 30 + [(49152, 576)]


def variant_source(name: str, tiles: tuple, ahead: int) -> tuple[str, str]:
    """The kernel's source with `tiles` as its dispatch on every instruction set and its prefetch
    `ahead` blocks of w ahead, registered as `torch.ops.<namespace>.gemv` so that several variants
    load into one process."""
    src = cpu_ops.SOURCE.read_text()
    (one, few, many) = tiles
    for old, new in (("(n0 + RW + j)", f"(n0 + {max(ahead, 1)} * RW + j)"),
                     ("RW > 1 && b + 1 < end ? RW : 0", f"b + {ahead} < end && {ahead} > 0 ? RW : 0")):
        assert src.count(old) == 1, "the kernel's prefetch changed: update this script"
        src = src.replace(old, new)
    dispatch = (f"if (M == 1) product<{one[0]}, {one[1]}>(xp, wp, yp, M, K, N);\n"
                f"  else if (M < 4) product<{few[0]}, {few[1]}>(xp, wp, yp, M, K, N);\n"
                f"  else product<{many[0]}, {many[1]}>(xp, wp, yp, M, K, N);\n")
    src, n = re.subn(r"#if defined\(__AVX512F__\)\n  [^\n]*product<.*?#endif\n", dispatch, src, flags=re.S)
    assert n == 1, "the kernel's dispatch block changed: update this script"
    src = re.sub(r'  m.impl\("(gemv|decode)_\w+", [^\n]*\n', "", src)  # the products over exact codes: not timed here
    namespace = "tiles_" + re.sub(r"\W", "_", name)
    src, n = re.subn(r"TORCH_LIBRARY_IMPL\(dflow_rt, CPU, m\) \{\n  m.impl\(\"gemv\", &gemv\);",
                     f'TORCH_LIBRARY({namespace}, m) {{\n  m.def("gemv(Tensor x, Tensor w) -> Tensor", &gemv);', src)
    assert n == 1, "the kernel's registration changed: update this script"
    return namespace, src


def build(name: str, tiles: tuple, ahead: int, root: Path):
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    namespace, src = variant_source(name, tiles, ahead)
    out = root / namespace
    out.mkdir()
    (out / "gemv.cpp").write_text(src)
    shutil.copy(cpu_ops.HEADER, out / cpu_ops.HEADER.name)
    options = CppTorchOptions(vec_isa=pick_vec_isa(), include_pytorch=True, shared=True, extra_flags=cpu_ops.FLAGS)
    builder = CppBuilder(name=namespace, sources=[str(out / "gemv.cpp")], BuildOption=options, output_dir=str(out))
    builder.build()
    torch.ops.load_library(builder.get_target_file_path())
    return getattr(torch.ops, namespace).gemv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=7, help="interleaved passes over all variants")
    p.add_argument("--steps", type=int, default=3, help="whole steps timed per pass (their median)")
    p.add_argument("--set", choices=SETS, default="tiles", help="which variants (the first is the baseline)")
    p.add_argument("--huge-pages", action="store_true",
                   help="the weights in huge pages, as a Runtime places them (the read probe stays in 4 KB pages)")
    args = p.parse_args()
    variants = SETS[args.set]
    torch.set_num_threads(args.threads)
    assert cpu_ops.enabled(), "the shipped kernel does not build or load here"
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"instruction set {isa}, {args.threads} threads, torch {torch.__version__}")
    weights = [torch.randn(n, k) for n, k in STEP]
    if args.huge_pages:
        held = torch.nn.ParameterList(weights)
        assert huge_pages.place(held), "huge pages unavailable here"
        weights = [w.data for w in held]
    gb = sum(w.numel() for w in weights) * 4 / 1e9
    flat = torch.cat([w.flatten() for w in weights])
    with tempfile.TemporaryDirectory() as root:
        kernels = {name: build(name, tiles, ahead, Path(root)) for name, (tiles, ahead) in variants.items()}
    shipped = torch.ops.dflow_rt.gemv
    for rows in args.rows:  # bit-identical to the shipped kernel, every shape and row count
        for n, k in set(STEP):
            x, w = torch.randn(rows, k), torch.randn(n, k)
            for name, gemv in kernels.items():
                assert torch.equal(gemv(x, w), shipped(x, w)), f"{name} differs at rows {rows}, [{n}, {k}]"
    print(f"all variants bit-identical to the shipped kernel; one step reads {gb:.2f} GB")

    def step(gemv, xs):
        for w in weights:
            gemv(xs[w.shape[1]], w)

    def timed(fn, *fn_args) -> float:
        ts = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn(*fn_args)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    results: dict[tuple, list[float]] = {}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        for gemv in kernels.values():
            step(gemv, xs)  # warm
        for _ in range(args.repeats):
            results.setdefault(("read", rows), []).append(timed(flat.sum))
            for name, gemv in kernels.items():
                results.setdefault((name, rows), []).append(timed(step, gemv, xs))
    first = next(iter(variants))
    for rows in args.rows:
        base = statistics.median(results[(first, rows)])
        read = statistics.median(results[("read", rows)])
        print(f"rows {rows}: read {gb / read:.1f} GB/s ({read * 1e3:.1f} ms)")
        for name in variants:
            t = statistics.median(results[(name, rows)])
            print(f"  {name:14s} {t * 1e3:6.1f} ms  {gb / t:5.1f} GB/s  {base / t:5.3f}x {first}  "
                  f"{read / t * 100:3.0f} % of the read")


if __name__ == "__main__":
    main()
