"""Every use of torch's private interfaces, in one place, for the torch versions in SUPPORTED.

The compiled rounds lean on parts of torch that carry no stability promise: dynamo's ahead-of-time
compilation, its compiled functions' guards and serialisation (compiled rounds kept on disk, guards
checked when a request is admitted rather than at every step), its recompile limits and dynamic
dimensions, inductor's configuration (the C++ wrapper, freezing, GEMM templates) and inductor's C++
builder (the CPU kernels, `dflow_rt.kernels.cpu.ops`). Each use is a small function here, saying
why it is needed; the rest of the package calls these only.

`known()` is the one switch: on a torch whose version SUPPORTED does not list, it is False (and the
process says so in one line): compiled rounds are then plain `torch.compile` with its guards, at
inductor's default settings (no graphs compiled ahead of time, none kept on disk, no guard skipped),
slower to start and to step but built on torch's public interface. What plain `torch.compile`
needs there too (dynamic lengths, recompile limits) stays on. The CPU kernels still try to build:
a failure is logged and torch's ops serve instead.

A C++ compiler is looked up here too (`cpp_compiler`): without one, CPU rounds run eager and
without the C++ kernels, said in one line (`say_no_compiler`).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

log = logging.getLogger("dflow_rt")

SUPPORTED = ("2.13",)  # torch versions (major.minor) this module was tested with
_said: set[str] = set()  # the one-line warnings this process has logged


def _once(key: str, message: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(message, *args)


def version() -> str:
    """torch's major.minor version, as SUPPORTED lists them ("2.13" for "2.13.0+cpu")."""
    return ".".join(str(torch.__version__).split("+")[0].split(".")[:2])


def known() -> bool:
    """Whether this torch is one SUPPORTED lists: the one switch between the compiled rounds that use
    torch's internals (ahead-of-time graphs kept on disk, guards checked at admission, inductor
    settings) and plain `torch.compile` with its guards. False is said once per process."""
    if version() in SUPPORTED:
        return True
    _once("torch", "torch %s is not a version dflow-rt is tested with (%s): compiled rounds run plain "
          "torch.compile with its guards, neither compiled ahead of time nor kept on disk",
          torch.__version__, ", ".join(SUPPORTED))
    return False


# ------------------------------------------------------------------ compiling the rounds


def compile_function(fn: Callable, backend: str, recompiles: int) -> Callable:
    """`fn` under `torch.compile` whole (`fullgraph`) at fixed shapes (bar dimensions marked dynamic),
    compiling on its first call. All the Runtimes of a process compile the same round function, whose
    code object dynamo caches graphs on, `recompile_limit` (8) at most by default: where torch.compile
    takes its own limit and region (`recompile_limit`, `isolate_recompiles`), this function's graphs
    count against its `recompiles` alone, and no global limit is raised; elsewhere `compiling` raises
    dynamo's limits while a Runtime builds."""
    extra = {}
    if {"recompile_limit", "isolate_recompiles"} <= inspect.signature(torch.compile).parameters.keys():
        extra = {"recompile_limit": recompiles, "isolate_recompiles": True}
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, **extra)


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Within: dynamo's process-wide cap on the graphs of one function lifted, and restored on leaving
    (a Runtime compiles its rounds here, and nowhere else). Dynamo counts every graph it ever compiled
    of a function against `accumulated_recompile_limit` (256), so a process that builds many Runtimes
    (tests, `dflow-rt autotune`) would reach it; each Runtime's own graphs stay bounded by
    `compile_function`'s limit. Where torch.compile has no limit of its own, the shared
    `recompile_limit` is lifted here too (only while a Runtime builds: a step never compiles)."""
    cfg = getattr(getattr(torch, "_dynamo", None), "config", None)
    wanted = {"accumulated_recompile_limit": 1 << 30}
    if "recompile_limit" not in inspect.signature(torch.compile).parameters:
        wanted["recompile_limit"] = 1 << 30
    patch = {k: max(v, getattr(cfg, k)) for k, v in wanted.items() if hasattr(cfg, k)}
    with cfg.patch(patch) if patch else contextlib.nullcontext():
        yield


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Trace dimension `dim` of `t` as a symbol (`torch._dynamo.mark_dynamic`; torch.compile has no
    public spelling of it): one graph serves every cache length."""
    torch._dynamo.mark_dynamic(t, dim)


def inductor_settings(cpu: bool, freeze: bool) -> contextlib.AbstractContextManager:
    """Inductor's settings for compiled rounds (why each: `dflow_rt.graphs.runner.compiling`): the
    weights `freeze` folded in as constants; on CPU the C++ wrapper and merged projections, and frozen
    also inductor's C++ GEMM templates tried against the GEMM library. Inductor's defaults on a
    torch not `known()`: its configuration's names change between versions."""
    if not known():
        return contextlib.nullcontext()
    templates = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"} if freeze and cpu else {}
    return torch._inductor.config.patch({"freezing": freeze, "cpp_wrapper": cpu, "cpp.enable_concat_linear": cpu,
                                         **templates})


def aot_compile(fn: Callable, backend: str, args: tuple, kwargs: dict) -> Callable:
    """`fn` compiled ahead of time for `fn(*args, **kwargs)` (`torch.compile(...).aot_compile`): a
    graph with its guards that `serialize` writes whole and `deserialize` loads without tracing again."""
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend).aot_compile((args, kwargs))


def serialize(fn: Callable, external: dict) -> bytes:
    """The bytes of graph `fn` (an `aot_compile` result), its modules left out and named by `external`."""
    return type(fn).serialize(fn, external).serialized_data


def deserialize(blob: bytes, external: dict) -> Callable:
    """The graph `serialize` wrote, its modules given back by `external` (raises when torch refuses it)."""
    return torch.compiler.load_compiled_function(io.BytesIO(blob), external_data=external)


def is_ahead_of_time(fn: Callable) -> bool:
    """Whether `fn` is a graph compiled ahead of time (`aot_compile`), whose guards we check ourselves."""
    return hasattr(fn, "disable_guard_check") and hasattr(fn, "guard_check")


def guard_failure(fn: Callable, args: tuple, kwargs: dict) -> str:
    """Why the guards of graph `fn` (compiled ahead of time) reject `fn(*args, **kwargs)`, or "" when
    they accept it: the failing guards' code, from dynamo's guard manager (which the compiled
    function's public `guard_check` answers only yes or no about)."""
    if fn.guard_check(*args, **kwargs):
        return ""
    f_locals = fn.prepare_f_locals(*args, **kwargs)
    return str(fn._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)[:300]


def skip_guard_checks(fn: Callable) -> None:
    """Graph `fn` (compiled ahead of time) stops checking its guards on every call; the Runtime checks
    them itself (`guard_failure`) where something they cover can have changed."""
    fn.disable_guard_check()


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bfloat16 products natively (AVX512-BF16 or AMX); without, they are
    emulated. torch answers it only through a private oneDNN op."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# ------------------------------------------------------------------ building the CPU kernels


def cpp_compiler() -> str | None:
    """The C++ compiler inductor's builder runs (`$CXX`, else g++; clang++ on macOS), when it is on
    PATH, else None. Looked up here rather than by inductor (whose search imports its code generator,
    seconds): CPU rounds compiled by inductor and the C++ kernels both need it."""
    return shutil.which(_compiler_name())


def _compiler_name() -> str:
    return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


def say_no_compiler() -> None:
    """The one line (once per process) a process without a C++ compiler gets."""
    _once("compiler", "no C++ compiler: %s is not on PATH (or set CXX to one), so CPU rounds run eager, without "
          "the C++ kernels", _compiler_name())


_ISAS = {"AVX512": "VecAVX512", "AVX2": "VecAVX2"}  # torch's instruction set names -> inductor's classes


def build_library(name: str, sources: Sequence[Path], output_dir: Path, flags: Sequence[str],
                  isa: str | None = None) -> Path:
    """The shared library `name` built from C++ `sources` (which include torch's headers and register
    ops with TORCH_LIBRARY) with `flags`, under `output_dir`; returns its path. Built by inductor's
    C++ builder, which knows torch's include and link flags and the vector flags of each instruction
    set: `isa` (torch's name, "AVX512" or "AVX2"), or None for the best this CPU runs."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions

    if isa is not None and isa not in _ISAS:
        raise ValueError(f"no build for instruction set {isa!r} (one of {', '.join(_ISAS)})")
    vec_isa = cpu_vec_isa.pick_vec_isa() if isa is None else getattr(cpu_vec_isa, _ISAS[isa])()
    options = CppTorchOptions(vec_isa=vec_isa, include_pytorch=True, shared=True, extra_flags=tuple(flags))
    builder = CppBuilder(name=name, sources=[str(f) for f in sources], BuildOption=options,
                         output_dir=str(output_dir))
    builder.build()
    return Path(builder.get_target_file_path())
