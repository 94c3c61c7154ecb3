"""Products of a few rows on CPU (`kernels/cpu/gemv.cpp`): what every decode and verify pass is made of.

A batch-1 step multiplies one row by every weight matrix, so it is a read of the weights; torch's
GEMM library streams them at about half the machine's read bandwidth at 1 row and slower at 2-4
(`bench/cpu_gemv.py`), so a verify pass of 2 positions cost 1.5 plain steps. The C++ kernel reads
each weight row once for all the rows of x. It is built on first use with the compiler inductor
uses (tens of seconds, once: the library is kept under the cache directory), used for float32
products of at most MAX_ROWS rows without autograd on CPUs with AVX-512 or AVX2 (one source, a tile
per instruction set), and `linear` falls back to `F.linear` everywhere else. DFLOW_RT_CPU_GEMV=0
turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("dflow_rt")
SOURCE = Path(__file__).with_name("gemv.cpp")
# one library: the products, the cache attention (`dflow_rt.kernels.attention`), the eager passes' small
# ops and their vector header
SOURCES = (SOURCE, SOURCE.with_name("attention.cpp"), SOURCE.with_name("eager.cpp"))
HEADER = SOURCE.with_name("vec.h")
KEEP_BUILDS = 3  # kernel builds kept under the cache directory, this one included
MAX_ROWS = 16  # a decode or verify pass (a batch of 4 at verify width 4); prefill stays with the library
FLAGS = ("-O3", "-ffp-contract=off")  # no multiply-add fused behind our back: exact codes rebuild weights exactly
ISAS = ("AVX512", "AVX2")  # torch's names for the instruction sets the kernel has a tile for
CODE_KINDS = ("u4", "i8", "b16")
CODE_GROUP = 4  # rows of a weight stored together in its codes (`kGroup` in kernels/cpu/gemv.cpp)
_ready: bool | None = None  # None: not tried yet in this process


def enabled() -> bool:
    """Whether `linear` may use the kernel in this process (built or loaded on the first call)."""
    global _ready
    if _ready is None:
        if torch.compiler.is_compiling():  # never built inside a trace: `graphs.runner` loads it before
            return False
        _ready = _load()
    return _ready


def _load() -> bool:
    isa = torch.backends.cpu.get_cpu_capability()
    if os.environ.get("DFLOW_RT_CPU_GEMV", "1") == "0" or isa not in ISAS:
        return False
    from dflow_rt.paths import cache_root

    # the flags and the ISA are in the key: a cache shared by two machines keeps a build each
    source = b"".join(f.read_bytes() for f in (*SOURCES, HEADER)) + " ".join(FLAGS).encode()
    digest = hashlib.sha256(source + torch.__version__.encode() + isa.encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"cpu_gemv_{digest}"
    library = out / "cpu_ops.so"
    try:
        if not library.exists():
            log.warning("building the CPU product kernel (once, tens of seconds): %s", out)
            _build(out, library)
        torch.ops.load_library(str(library))
    except Exception as err:  # no compiler, a broken build: the GEMM library serves every product
        log.warning("CPU product kernel unavailable (%s); torch's GEMM library serves every product", err)
        return False
    return True


def _build(out: Path, library: Path) -> None:
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    options = CppTorchOptions(vec_isa=pick_vec_isa(), include_pytorch=True, shared=True, extra_flags=FLAGS)
    builder = CppBuilder(name="cpu_gemv", sources=[str(f) for f in SOURCES], BuildOption=options, output_dir=str(tmp))
    builder.build()
    out.mkdir(parents=True, exist_ok=True)
    os.replace(builder.get_target_file_path(), library)  # atomic: a concurrent builder finds a whole library or none
    shutil.rmtree(tmp, ignore_errors=True)
    _prune(out)


def _prune(current: Path, keep: int = KEEP_BUILDS) -> None:
    """Builds of other sources or torch versions pile up one directory each: keep the newest few (another
    environment sharing the cache may still use them; one removed in use stays loaded where it is)."""
    others = [d for d in current.parent.glob("cpu_gemv_*") if d != current and d.is_dir() and ".tmp" not in d.name]
    for old in sorted(others, key=lambda d: d.stat().st_mtime, reverse=True)[keep - 1:]:
        shutil.rmtree(old, ignore_errors=True)


_library = torch.library.Library("dflow_rt", "DEF")  # the schemas; SOURCES register the CPU implementations
_library.define("gemv(Tensor x, Tensor w) -> Tensor")
for _kind in CODE_KINDS:  # products over, and values of, weights in exact codes (`dflow_rt.models.exact_codes`)
    _library.define(f"gemv_{_kind}(Tensor x, Tensor codes) -> Tensor")
    _library.define(f"decode_{_kind}(Tensor codes) -> Tensor")
    torch.library.register_fake(f"dflow_rt::gemv_{_kind}",
                                lambda x, codes: x.new_empty(x.shape[0], codes.shape[0] * CODE_GROUP))


# Flexible layout: the kernel reads k and v through their strides, so the compiled graph hands it the
# cache it has just written in place. Without the tag inductor copied each layer's cache into the
# contiguous layout of the traced value first: a copy per layer that grows with the context.
_library.define("cache_attention(Tensor q, Tensor k, Tensor v, Tensor start, bool causal) -> Tensor",
                tags=(torch.Tag.flexible_layout,))


# the eager passes' small ops (`kernels/cpu/eager.cpp`): never traced, so no shape functions
_library.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_library.define("rope_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
                "Tensor(b!) v_cache, Tensor positions) -> Tensor")


@torch.library.register_fake("dflow_rt::cache_attention")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, causal: bool) -> torch.Tensor:
    b, heads, rows, d = q.shape
    return q.new_empty(b, rows, heads, d).transpose(1, 2)


@torch.library.register_fake("dflow_rt::gemv")
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


class Codes(NamedTuple):
    """A weight in exact codes (`dflow_rt.models.exact_codes`): the products rebuild its float32 values."""
    kind: str  # one of CODE_KINDS
    codes: torch.Tensor  # uint8 [N / CODE_GROUP, bytes]: each block's scales and codes (kernels/cpu/gemv.cpp)
    version: int  # the weight's `_version` when it was coded: a weight changed since is no longer served


def _served(x: torch.Tensor, weight: torch.Tensor) -> int:
    """Rows of `x` when the kernel serves `F.linear(x, weight)` (see the module docstring), else 0."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (0 < rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) and enabled()):
        return rows
    return 0


def _current(codes: Codes | None, weight: torch.Tensor) -> bool:
    """Whether `codes` stand for `weight` as it is (compiled rounds rely on the Runtime's check)."""
    return codes is not None and (torch.compiler.is_compiling() or codes.version == weight._version)


def _coded_product(x: torch.Tensor, codes: Codes) -> torch.Tensor:
    return getattr(torch.ops.dflow_rt, f"gemv_{codes.kind}")(x, codes.codes)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           codes: Codes | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the kernel where it serves (see the module docstring),
    streaming `codes` instead of `weight` where the weight has them and has not changed since."""
    rows = _served(x, weight)
    if not rows:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    y = _coded_product(flat, codes) if _current(codes, weight) else torch.ops.dflow_rt.gemv(flat, weight.contiguous())
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def linear_parts(x: torch.Tensor, layers: Sequence[Linear], merged: Codes | None) -> list[torch.Tensor]:
    """`[layer(x) for layer in layers]` (projections of one input), as one product over `merged`, the
    layers' codes stacked (`exact_codes.attach`), where their codes serve: a product has a fixed cost
    (a call, a fork of threads), a tenth of a small one's time at one row."""
    if merged is None or not _served(x, layers[0].weight) or not all(_current(m.codes, m.weight) for m in layers):
        return [m(x) for m in layers]
    y = _coded_product(x.reshape(-1, x.shape[-1]).contiguous(), merged).reshape(*x.shape[:-1], -1)
    parts = y.split([m.weight.shape[0] for m in layers], -1)
    return [p if m.bias is None else p + m.bias for p, m in zip(parts, layers, strict=True)]


def eager_served(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the C++ small ops (`kernels/cpu/eager.cpp`) serve a pass over `x` whose products the kernel serves:
    eager passes only, as a compiled pass fuses torch's small ops into its neighbours."""
    return not torch.compiler.is_compiling() and _served(x, weight) > 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (normalised in float32, then scaled in x's dtype), by the C++ op where `eager_served`,
    else by torch's (an eager pass pays about 10 us a call for its chain of small ops)."""
    if eager_served(x, weight):
        return torch.ops.dflow_rt.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x, weight.shape, None, eps)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state dict) whose products go through `linear`, from the
    weight's exact codes once `exact_codes.attach` gave it some."""

    codes: Codes | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.codes)
