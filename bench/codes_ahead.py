"""How far ahead the products over exact codes prefetch their stream (`kAhead` in
`dflow_rt/kernels/cpu/gemv.cpp`): the kernel's source built once per distance as a library of its
own, each checked bit-identical to the shipped kernel, then timed on one step's products over a
real target's codes (every coded weight once), distances interleaved, each pass after a read of
256 MB that evicts the codes from the caches, as a decode step finds them.

    python bench/codes_ahead.py --target smollm2 --threads 2 --ahead 0 512 2048 8192 --rows 1 2 4 8

The first distance is the baseline; 0 is the hardware prefetcher alone.
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
from dflow_rt.models import exact_codes
from dflow_rt.models.bundled import load_models


def build(ahead: int, root: Path):
    """The shipped source with `ahead` bytes as its distance, its coded products registered as
    `torch.ops.ahead_<n>.gemv_<kind>` so that every distance loads into one process."""
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    namespace = f"ahead_{ahead}"
    defs = "".join(f'  m.def("gemv_{k}(Tensor x, Tensor codes) -> Tensor", &coded_gemv<{k.upper()}>);\n'
                   for k in cpu_ops.CODE_KINDS)
    registration = f"TORCH_LIBRARY({namespace}, m) {{\n{defs}}}\n"
    src, n = re.subn(r"TORCH_LIBRARY_IMPL\(dflow_rt, CPU, m\) \{.*?\n\}\n", registration,
                     cpu_ops.SOURCE.read_text(), flags=re.S)
    assert n == 1, "the kernel's registration changed: update this script"
    out = root / namespace
    out.mkdir()
    (out / "gemv.cpp").write_text(src)
    shutil.copy(cpu_ops.HEADER, out / cpu_ops.HEADER.name)
    options = CppTorchOptions(vec_isa=pick_vec_isa(), include_pytorch=True, shared=True,
                              extra_flags=(*cpu_ops.FLAGS, f"-DDFLOW_RT_CODES_AHEAD={ahead}"))
    builder = CppBuilder(name=namespace, sources=[str(out / "gemv.cpp")], BuildOption=options, output_dir=str(out))
    builder.build()
    torch.ops.load_library(builder.get_target_file_path())
    return getattr(torch.ops, namespace)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ahead", type=int, nargs="+", default=[0, 512, 2048, 8192],
                   help="distances in bytes; the first is the baseline")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=7, help="interleaved passes over all distances")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_ops.enabled(), "the CPU product kernel does not build or load here"
    target, _, _ = load_models(args.target, None, "cpu", args.threads, True, None)
    layers = {id(m.weight): m for m in target.modules() if isinstance(m, cpu_ops.Linear)}.values()
    coded = [(m.weight.shape[1], c) for m in layers if (c := exact_codes.encode(m.weight)) is not None]
    mb = sum(c.codes.numel() for _, c in coded) / 1e6
    with tempfile.TemporaryDirectory() as root:
        libs = {a: build(a, Path(root)) for a in args.ahead}
    print(f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, torch {torch.__version__}; "
          f"{len(coded)} coded weights, {mb:.0f} MB a step")

    def product(lib, x: torch.Tensor, c: exact_codes.Codes) -> torch.Tensor:
        return getattr(lib, f"gemv_{c.kind}")(x, c.codes)

    for rows in args.rows:
        for k, c in coded:
            x = torch.randn(rows, k)
            for a, lib in libs.items():
                assert torch.equal(product(lib, x, c), product(torch.ops.dflow_rt, x, c)), f"ahead {a} differs"
    print("every distance bit-identical to the shipped kernel")
    evict = torch.ones(64 << 20)
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k, _ in coded}
        runs: dict[int, list[float]] = {a: [] for a in libs}
        for _ in range(args.repeats):
            for a, lib in libs.items():
                evict.sum()
                t = time.perf_counter()
                for k, c in coded:
                    product(lib, xs[k], c)
                runs[a].append(time.perf_counter() - t)
        t = {a: statistics.median(v) for a, v in runs.items()}
        base = t[args.ahead[0]]
        print(f"rows {rows}: " + ", ".join(f"{a} B {s * 1e3:.2f} ms ({base / s:.2f}x, {mb / 1e3 / s:.1f} GB/s)"
                                           for a, s in t.items()))


if __name__ == "__main__":
    main()
