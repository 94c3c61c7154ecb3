"""Which implementation serves each op: `torch` (the reference), `triton` (the round's fused ops),
`flashinfer` (attention only, CUDA) or `cpu` (the C++ kernels of `kernels/cpu/`: the attention, and
the models' products with the eager passes' small ops, `linear`).

Nothing here imports triton or flashinfer until an implementation that needs them is asked for, so
`import dflow_rt` works on an install without them (the CPU one may lack triton).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from dflow_rt.errors import InputError

OPS = ("commit", "sample", "attention", "linear")
IMPLEMENTATIONS = ("torch", "triton", "flashinfer", "cpu")
SERVES = {"torch": OPS, "triton": ("commit", "sample", "attention"), "flashinfer": ("attention",),
          "cpu": ("attention", "linear")}  # the ops each implementation has a version of


@functools.cache
def importable(name: str) -> bool:
    """Whether `import name` works (not merely whether the package is installed)."""
    try:
        importlib.import_module(name)
    except Exception:  # a broken install (missing CUDA libraries, ABI mismatch) counts as absent
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1): tests only."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def implementation_for(op: str, requested: str, device: torch.device | str) -> str:
    """The implementation that serves `op` on `device` when `requested` ("auto" or an implementation).

    auto: flashinfer for the attention on CUDA when it imports, else triton on CUDA when it
    imports (torch for the products), else torch; on CPU the C++ kernels for the attention and the
    products (each hands what it does not serve, bf16 or a prefill, to torch), torch for the rest.
    On CPU, triton runs only when asked for by name under the interpreter. An implementation asked
    for by name that cannot run, or has no version of `op` (`SERVES`), raises InputError.
    """
    if op not in OPS:
        raise InputError(f"kernel op must be one of {', '.join(OPS)}, got {op!r}")
    cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        if cuda and op == "attention" and importable("flashinfer"):
            return "flashinfer"
        if not cuda and op in SERVES["cpu"]:
            return "cpu"
        return "triton" if cuda and op in SERVES["triton"] and importable("triton") else "torch"
    if requested in SERVES and op not in SERVES[requested]:
        raise InputError(f"{requested} serves only {' and '.join(SERVES[requested])}, not {op!r}")
    if requested == "torch":
        return requested
    if requested == "flashinfer":
        if not cuda:
            raise InputError("kernel implementation 'flashinfer' needs a CUDA device")
        if not importable("flashinfer"):
            raise InputError("kernel implementation 'flashinfer' asked for, but `import flashinfer` fails")
        return requested
    if requested == "cpu":
        if cuda:
            raise InputError("kernel implementation 'cpu' needs a CPU device")
        return requested
    if requested == "triton":
        if not importable("triton"):
            raise InputError("kernel implementation 'triton' asked for, but `import triton` fails: "
                             "pip install 'triton>=3.5'")
        if not cuda and not interpreting():
            raise InputError("kernel implementation 'triton' needs a CUDA device (or TRITON_INTERPRET=1, for tests)")
        return requested
    raise InputError(f"kernel implementation must be 'auto' or one of {', '.join(IMPLEMENTATIONS)}, "
                     f"got {requested!r}")


@dataclass(frozen=True)
class Kernels:
    """The resolved function of every op (same signature whatever serves it) and its implementation."""

    implementations: Mapping[str, str]
    commit: Callable
    sample: Callable
    attention: Callable
    linear: Callable  # the models' products: their modules are routed to it (`cpu_ops.route`)


def select(spec: str | Mapping[str, str] = "auto", device: torch.device | str = "cpu") -> Kernels:
    """Resolve a `RuntimeConfig.kernels` spec: one implementation (or "auto") for every op it has a
    version of ("auto" for the others), or a dict op -> implementation whose missing ops are "auto"."""
    if isinstance(spec, str):
        requested = {op: spec if op in SERVES.get(spec, OPS) else "auto" for op in OPS}
    else:
        unknown = set(spec) - set(OPS)
        if unknown:
            raise InputError(f"kernel ops must be among {', '.join(OPS)}, got {sorted(unknown)}")
        requested = {op: spec.get(op, "auto") for op in OPS}
    chosen = {op: implementation_for(op, requested[op], device) for op in OPS}
    return Kernels(chosen, **{op: load(op, name) for op, name in chosen.items()})


def select_for(spec: str | Mapping[str, str], target, drafter) -> Kernels:
    """`select` on the models' device, FlashInfer configured with their attention shapes; where
    FlashInfer cannot serve them (fp32, an odd head size) and the spec said "auto", the next choice."""
    kernels = select(spec, target.lm_head.weight.device)
    if kernels.implementations["attention"] != "flashinfer":
        return kernels
    try:
        kernels.attention.configure_models(target, drafter)
    except ValueError as e:
        if (spec if isinstance(spec, str) else spec.get("attention", "auto")) != "auto":
            raise InputError(str(e)) from e
        fallback = "triton" if importable("triton") else "torch"
        chosen = {**kernels.implementations, "attention": fallback}
        return replace(kernels, implementations=chosen, attention=load("attention", fallback))
    return kernels


def load(op: str, implementation: str) -> Callable:
    """The function serving `op` as `implementation` (imports its module now; triton at its first launch)."""
    if implementation == "flashinfer":
        from dflow_rt.kernels.flashinfer_attention import FlashInferAttention

        return FlashInferAttention()
    if op == "linear":
        from dflow_rt.kernels.cpu import ops as cpu_ops

        return cpu_ops.linear if implementation == "cpu" else torch.nn.functional.linear
    module = importlib.import_module(f"dflow_rt.kernels.{op}")
    return getattr(module, f"{op}_{implementation}")


@functools.cache
def triton_kernel(fn: Callable) -> Callable:
    """`fn` as a Triton kernel, decorated on its first launch.

    Kernel modules define plain functions over a module global `tl` that is bound here:
    importing them needs no triton, and TRITON_INTERPRET (which triton reads when it decorates)
    takes effect whenever it is set before the first launch.
    """
    import triton
    import triton.language as tl

    fn.__globals__["tl"] = tl
    return triton.jit(fn)
