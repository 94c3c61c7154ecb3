"""Products of a few rows on CPU (`kernels/cpu/gemv.cpp`): what every decode and verify pass is made of.

A batch-1 step multiplies one row by every weight matrix, so it is a read of the weights; torch's
GEMM library streams them at about half the machine's read bandwidth at 1 row and slower at 2-4
(`bench/cpu_gemv.py`), so a verify pass of 2 positions cost 1.5 plain steps. The C++ kernel reads
each weight row once for all the rows of x. It is built on first use with the compiler inductor
uses (tens of seconds, once: the library is kept under the cache directory), used for float32
products of at most MAX_ROWS rows without autograd on CPUs with AVX-512 or AVX2 (one source, a tile
per instruction set), and `linear` falls back to `F.linear` everywhere else.

A Runtime routes its models' passes here or to torch through `RuntimeConfig.kernels` (op "linear":
"cpu", the default on CPU, or "torch"; `route`). The library (all of SOURCES) has one build path,
`build` (through `dflow_rt.compat.build_library`): `enabled` builds it for this CPU, and tests
build the other instruction set's code with it. A failed build is logged and leaves the kernels
off; a process without the C++ compiler skips the build and says so in one line
(`compat.say_no_compiler`). A cold start may `defer` the build to another process (torch's ops
serve meanwhile) and `resume` once the library is on disk. Debugging override: DFLOW_RT_CPU_GEMV=0
in the environment keeps the kernels off in a whole process that could build them (torch's ops
serve every product, attention and eager pass, as on a CPU without AVX2), e.g. to compare against them;
DFLOW_RT_EXACT_CODES=0 (`dflow_rt.models.exact_codes`) keeps only the products over weight codes off.
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

from dflow_rt import compat

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
CODE_BLOCK = 32  # values of a row per block of codes (`kBlock`)
CODE_RECORD = {"u4": CODE_GROUP * (8 + 16), "i8": CODE_GROUP * (4 + 32), "b16": CODE_GROUP * 64}  # bytes a block
_ready: bool | None = None  # None: not tried yet in this process
_deferred = False  # `defer`: off in this process until the library is on disk (`resume`)


def enabled() -> bool:
    """Whether `linear` may use the kernel in this process (built or loaded on the first call)."""
    global _ready
    if _ready is None:
        if torch.compiler.is_compiling():  # never built inside a trace: `graphs.runner` loads it before
            return False
        _ready = _load()
    return _ready


def defer() -> bool:
    """A cold start's choice: where the library is not on disk yet, keep the kernels off in this
    process (torch's ops serve) instead of building them before the first answer (tens of seconds);
    another process builds them (the detached build of the compiled rounds) and `resume` loads them.
    True when deferred; False where they are loaded, on disk, or cannot run here anyway."""
    global _ready, _deferred
    if _ready is not None:
        return _deferred
    library = library_path()
    if library is None or library.exists():
        return False
    _ready, _deferred = False, True
    return True


def deferred() -> bool:
    return _deferred


def on_disk() -> bool:
    """Whether this CPU's build of the library is on disk (another process may have made it)."""
    library = library_path()
    return library is not None and library.exists()


def resume(build: bool = False) -> bool:
    """End a `defer` once the library is on disk (with `build`: building it here now if it is not);
    returns whether the kernels are on. A no-op (their state) where nothing was deferred."""
    global _ready, _deferred
    if _deferred:
        if not build and not on_disk():
            return False
        _ready, _deferred = None, False
    return enabled()


def _wanted() -> bool:
    """Not switched off (the debugging override), and a CPU the kernels have a tile for."""
    return os.environ.get("DFLOW_RT_CPU_GEMV", "1") != "0" and torch.backends.cpu.get_cpu_capability() in ISAS


def library_path() -> Path | None:
    """Where this CPU's build of the library lives, or None where the kernels cannot run here."""
    if not _wanted() or compat.cpp_compiler() is None:
        return None
    isa = torch.backends.cpu.get_cpu_capability()
    from dflow_rt.paths import cache_root

    # the flags and the ISA are in the key: a cache shared by two machines keeps a build each
    source = b"".join(f.read_bytes() for f in (*SOURCES, HEADER)) + " ".join(FLAGS).encode()
    digest = hashlib.sha256(source + torch.__version__.encode() + isa.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"cpu_gemv_{digest}" / "cpu_ops.so"


def _load() -> bool:
    library = library_path()
    if library is None:
        if _wanted():  # no compiler: one line for the process, not a failed build's
            compat.say_no_compiler()
        return False
    out = library.parent
    try:
        if not library.exists():
            log.warning("building the CPU product kernel (once, tens of seconds): %s", out)
            _build(out, library)
        torch.ops.load_library(str(library))
    except Exception as err:  # no compiler, a broken build: the GEMM library serves every product
        log.warning("CPU product kernel unavailable (%s); torch's GEMM library serves every product", err)
        return False
    return True


def build(name: str, sources: Sequence[Path], output_dir: Path, isa: str | None = None) -> Path:
    """The kernels' one build: the shared library `name` from `sources` with FLAGS under `output_dir`,
    for instruction set `isa` (one of ISAS; None: the best this CPU runs). Returns its path."""
    return compat.build_library(name, sources, output_dir, FLAGS, isa)


def _build(out: Path, library: Path) -> None:
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    built = build("cpu_gemv", SOURCES, tmp)
    out.mkdir(parents=True, exist_ok=True)
    os.replace(built, library)  # atomic: a concurrent builder finds a whole library or none
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
    torch.library.register_fake(f"dflow_rt::decode_{_kind}",
                                lambda codes, record=CODE_RECORD[_kind]: codes.new_empty(
                                    codes.shape[0] * CODE_GROUP, codes.shape[1] // record * CODE_BLOCK,
                                    dtype=torch.float32))


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
    ptr: int = 0  # the weight's `data_ptr()` then: a weight given other data since is no longer served either


def held(weight: torch.Tensor) -> bool:
    """Whether `weight` is held as its codes: its float32 storage released (`exact_codes.attach`), what
    is left one value (NaN) seen through zero strides, with the weight's shape, dtype and device. Its
    values are the codes' (`values`); it cannot be written in place."""
    return weight.numel() > 1 and not any(weight.stride())


def _served(x: torch.Tensor, weight: torch.Tensor) -> int:
    """Rows of `x` when the kernel serves `F.linear(x, weight)` (see the module docstring), else 0."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (0 < rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) and enabled()):
        return rows
    return 0


def _current(codes: Codes | None, weight: torch.Tensor) -> bool:
    """Whether `codes` stand for `weight` as it is (compiled rounds rely on the Runtime's check)."""
    return codes is not None and (torch.compiler.is_compiling() or (
        codes.version == weight._version and codes.ptr in (0, weight.data_ptr())))


def _coded_product(x: torch.Tensor, codes: Codes) -> torch.Tensor:
    return getattr(torch.ops.dflow_rt, f"gemv_{codes.kind}")(x, codes.codes)


def decode(codes: Codes) -> torch.Tensor:
    """The float32 weight `codes` stand for, rebuilt by the kernel exactly as its products rebuild it."""
    return getattr(torch.ops.dflow_rt, f"decode_{codes.kind}")(codes.codes)


def values(weight: torch.Tensor, codes: Codes | None) -> torch.Tensor:
    """`weight`'s float32 values: decoded from `codes` (a new tensor each call) where the weight is
    `held` as them, else the weight itself."""
    if codes is not None and held(weight) and _current(codes, weight):
        return decode(codes)
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           codes: Codes | None = None, kernel: bool = True) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the kernel where it serves (see the module docstring),
    streaming `codes` instead of `weight` where the weight has them and has not changed since. A
    product the kernel does not serve (prefill's many rows, autograd) over a weight `held` as its
    codes multiplies by its decoded values: the same float32 weight, bit for bit. `kernel=False`:
    torch's product always (a module `route`d to torch)."""
    rows = _served(x, weight) if kernel else 0
    if not rows:
        return F.linear(x, values(weight, codes), bias)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    y = _coded_product(flat, codes) if _current(codes, weight) else torch.ops.dflow_rt.gemv(flat, weight.contiguous())
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def embedding(ids: torch.Tensor, weight: torch.Tensor, codes: Codes | None = None) -> torch.Tensor:
    """`F.embedding(ids, weight)`; where the weight is `held` as its codes, the rows of `ids` decoded
    from them (each id's group of CODE_GROUP rows, then its row): the same values, bit for bit."""
    if codes is None or not held(weight) or not _current(codes, weight):
        return F.embedding(ids, weight)
    flat = ids.reshape(-1)
    rows = getattr(torch.ops.dflow_rt, f"decode_{codes.kind}")(codes.codes[flat // CODE_GROUP].contiguous())
    picked = rows.view(flat.numel(), CODE_GROUP, -1)[torch.arange(flat.numel(), device=ids.device), flat % CODE_GROUP]
    return picked.reshape(*ids.shape, weight.shape[1])


def linear_parts(x: torch.Tensor, layers: Sequence[Linear], merged: Codes | None) -> list[torch.Tensor]:
    """`[layer(x) for layer in layers]` (projections of one input), as one product over `merged`, the
    layers' codes stacked (`exact_codes.attach`), where their codes serve: a product has a fixed cost
    (a call, a fork of threads), a tenth of a small one's time at one row."""
    if (merged is None or not layers[0].kernel or not _served(x, layers[0].weight)
            or not all(_current(m.codes, m.weight) for m in layers)):
        return [m(x) for m in layers]
    y = _coded_product(x.reshape(-1, x.shape[-1]).contiguous(), merged).reshape(*x.shape[:-1], -1)
    parts = y.split([m.weight.shape[0] for m in layers], -1)
    return [p if m.bias is None else p + m.bias for p, m in zip(parts, layers, strict=True)]


def eager_served(x: torch.Tensor, weight: torch.Tensor, kernel: bool = True) -> bool:
    """Whether the C++ small ops (`kernels/cpu/eager.cpp`) serve a pass over `x` whose products the kernel serves
    (`kernel`: the module is routed here): eager passes only, as a compiled pass fuses torch's small ops
    into its neighbours."""
    return kernel and not torch.compiler.is_compiling() and _served(x, weight) > 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel: bool = True) -> torch.Tensor:
    """HF's RMSNorm (normalised in float32, then scaled in x's dtype), by the C++ op where `eager_served`,
    else by torch's (an eager pass pays about 10 us a call for its chain of small ops)."""
    if eager_served(x, weight, kernel):
        return torch.ops.dflow_rt.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x, weight.shape, None, eps)


class _Coded:
    """What `Linear` and `Embedding` share: `codes` once `exact_codes.attach` gave the weight some; a
    state dict with the weight's float32 values where it is `held` as them (`save_model` writes
    those); loading one into a held weight gives it float32 storage again first."""

    codes: Codes | None = None
    kernel = True  # products through `linear`'s kernel where it serves; False: torch's (`route`)

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # a model built on the meta device to load weights into: nothing to draw
            super().reset_parameters()  # (and drawing there imports torch._dynamo, with triton where installed)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars and held(self.weight):
            destination[prefix + "weight"] = values(self.weight, self.codes).detach()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if held(self.weight) and prefix + "weight" in state_dict:
            self.weight.data = torch.empty(self.weight.shape, dtype=self.weight.dtype, device=self.weight.device)
            self.codes = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Linear(_Coded, nn.Linear):
    """`nn.Linear` (same parameters and state dict) whose products go through `linear`, from the
    weight's exact codes once `exact_codes.attach` gave it some."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.codes, self.kernel)


class Embedding(_Coded, nn.Embedding):
    """`nn.Embedding` (same parameters and state dict) whose rows come from the weight's codes where
    it is `held` as them (a tied head's table: the head's codes)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.codes is None:
            return super().forward(ids)
        return embedding(ids, self.weight, self.codes)


def route(implementation: str, *models: nn.Module | None) -> None:
    """Send the passes of `models` to `implementation` ("cpu": the kernels, where they serve;
    "torch": torch's ops only): every module with a `kernel` switch (products, RMSNorm, a drafter's
    head) is set. A weight held as its codes needs the kernel: give models sent to torch their
    float32 weights back first (`exact_codes.restore`, as a Runtime does)."""
    if implementation not in ("cpu", "torch"):
        raise ValueError(f"the products are served by 'cpu' or 'torch', not {implementation!r}")
    for model in (m for m in models if m is not None):
        for module in model.modules():
            if hasattr(type(module), "kernel"):
                module.kernel = implementation == "cpu"
