"""Float32 weights streamed in fewer bytes, exactly: codes that rebuild every value bit for bit.

A batch-1 step on CPU is a read of the weights, so its time is their bytes. Weights that came out
of a quantised file (SmolLM2 is published as a Q4_1 GGUF with a Q8_0 head; `fetch-model` stores it
dequantised to float32) hold far less than 32 bits each: per block of 32 along a row, every value is
d * q + m with q in 0..15 (kind "u4", 0.75 bytes a weight with its two float32 scales) or d * q with
q in -128..127 ("i8", 1.125 bytes). Weights kept as bfloat16 (the bundled drafters) hold 16 bits
each: their float32's low half is zero ("b16", 2 bytes). `encode` finds such codes when a weight has
them and keeps them only when the kernel's own decoder (`kernels/cpu/gemv.cpp`) gives back every float32 of
the weight bit for bit; the kernel then streams the codes, rebuilds each value and sums exactly as it
sums the float32 weight. Results, and so tokens, are identical; only the bytes read change. A weight without codes
(a drafter trained in float32, say) stays float32. `DFLOW_RT_EXACT_CODES=0` turns this off.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.kernels.cpu.ops import Codes

BLOCK = 32  # values per block along a row (the GGUF formats' block)
GROUP = cpu_ops.CODE_GROUP  # rows stored together; a weight's rows must be a multiple
LEVELS = {"u4": (0, 15), "i8": (-128, 127)}  # the range of q per kind
PROBE_ROWS = 64  # a weight is first tried on its first rows: float32 noise fails there, cheaply


def enabled() -> bool:
    """Whether Runtimes code their weights in this process (CPU product kernel built, not opted out)."""
    return os.environ.get("DFLOW_RT_EXACT_CODES", "1") != "0" and cpu_ops.enabled()


def _scale_candidates(estimate: torch.Tensor) -> list[torch.Tensor]:
    """Scales to try per block: the float16 nearest to the estimate (the GGUF formats store float16
    scales), its neighbours, then the float32 estimate itself."""
    half = estimate.half()
    bits = half.view(torch.int16)
    near = [(bits + step).view(torch.float16).float() for step in (1, -1, 2, -2)]
    return [half.float(), *near, estimate]


def _fit(blocks: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q, d, m) for `blocks` [R, B, BLOCK] with d * q + m == blocks exactly in float32, or None."""
    lo, hi = LEVELS[kind]
    if kind == "u4":
        m = blocks.amin(-1, keepdim=True)
        estimate = (blocks.amax(-1, keepdim=True) - m) / hi
    else:
        m = torch.zeros_like(blocks[..., :1])
        estimate = blocks.abs().amax(-1, keepdim=True) / hi
    q = torch.zeros_like(blocks, dtype=torch.int16)
    d = torch.zeros_like(m)
    todo = torch.ones(m.shape, dtype=torch.bool)
    for cand in _scale_candidates(estimate):
        safe = torch.where(cand > 0, cand, torch.ones_like(cand))
        qc = torch.where(cand > 0, ((blocks - m) / safe).round(), torch.zeros_like(blocks)).clamp(lo, hi)
        exact = (cand * qc + m == blocks).all(-1, keepdim=True) & todo
        q = torch.where(exact, qc.to(torch.int16), q)
        d = torch.where(exact, cand, d)
        todo &= ~exact
        if not todo.any():
            return q, d, m
    return None


def _pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: str, version: int) -> Codes:
    """The kernel's layout: rows in groups of GROUP, each group's blocks in order, a block's record
    the group's scales (float32) then its codes."""
    rows, blocks = q.shape[:2]
    if kind == "u4":  # byte j: element j in the low nibble, element j + 16 in the high one
        q = q.to(torch.uint8)
        codes, scales = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4), torch.cat([d, m], -1)
    else:
        codes, scales = q.to(torch.int8).view(torch.uint8), d

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [rows, blocks, n] -> [groups, blocks, GROUP * n]
        return t.reshape(rows // GROUP, GROUP, blocks, -1).transpose(1, 2).reshape(rows // GROUP, blocks, -1)

    record = torch.cat([grouped(scales.float().contiguous().view(torch.uint8)), grouped(codes)], -1)
    return Codes(kind, record.reshape(rows // GROUP, -1).contiguous(), version)


def _pack_b16(w: torch.Tensor, version: int) -> Codes:
    """A bfloat16-valued weight's high halves, in the kernel's layout (records without scales)."""
    rows = w.shape[0]
    high = (w.view(torch.int32) >> 16).to(torch.int16).view(torch.uint8)  # little-endian: 2 bytes a value
    record = high.reshape(rows // GROUP, GROUP, -1, 2 * BLOCK).transpose(1, 2)
    return Codes("b16", record.reshape(rows // GROUP, -1).contiguous(), version)


def _codes(w: torch.Tensor, blocks: torch.Tensor, kind: str, version: int) -> Codes | None:
    """Codes of `kind` that may stand for `w` (`encode` checks them), or None when it has none."""
    if kind == "b16":
        return None if (w.view(torch.int32) & 0xFFFF).any() else _pack_b16(w, version)
    if _fit(blocks[:PROBE_ROWS], kind) is None:
        return None
    fit = _fit(blocks, kind)
    return None if fit is None else _pack(*fit, kind, version)


def decode(codes: Codes) -> torch.Tensor:
    """The float32 weight `codes` stand for, rebuilt by the kernel exactly as its products rebuild it."""
    return getattr(torch.ops.dflow_rt, f"decode_{codes.kind}")(codes.codes)


@torch.no_grad()
def encode(weight: torch.Tensor) -> Codes | None:
    """Exact codes of a float32 CPU weight [N, K] (N a multiple of GROUP, K of BLOCK), or None when it
    has none."""
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0
            or weight.shape[1] % BLOCK or weight.shape[0] % GROUP or not cpu_ops.enabled()):
        return None
    w = weight.detach().contiguous()
    blocks = w.reshape(w.shape[0], -1, BLOCK)
    for kind in (*LEVELS, "b16"):
        codes = _codes(w, blocks, kind, weight._version)
        if codes is not None and torch.equal(decode(codes).view(torch.int32), w.view(torch.int32)):
            return codes  # bit for bit, -0.0 included
    return None


def attach(*models: nn.Module | None) -> dict[str, int] | None:
    """Give every float32 product of `models` (`cpu_ops.Linear` layers, a drafter's draft-vocabulary
    head) its exact codes where it has some, once per weight (a tied head is coded once), and drop
    codes a changed weight no longer matches. Returns bytes a step streams: {"coded": as coded,
    "float32": the same weights as float32, "plain": weights left float32}; None when codes are
    off here (`enabled`) or nothing could have codes (no float32 CPU weight: the kernel is not
    even built), after dropping any the models had."""
    candidates = any(p.device.type == "cpu" and p.dtype == torch.float32
                     for m in models if m is not None for p in m.parameters())
    if not candidates or not enabled():
        for model in models:
            for module in model.modules() if model is not None else ():
                if isinstance(module, cpu_ops.Linear):
                    module.codes = None
                if getattr(module, "parts", None):
                    module.merged = None
            if getattr(model, "vocab_codes", None) is not None:
                model.vocab_codes = None
        return None
    seen: dict[int, Codes | None] = {}
    sizes = {"coded": 0, "float32": 0, "plain": 0}

    def coded(weight: torch.Tensor, old: Codes | None) -> Codes | None:
        key = weight.data_ptr()
        if key not in seen:
            seen[key] = old if old is not None and old.version == weight._version else encode(weight)
            c = seen[key]
            if c is None:
                sizes["plain"] += weight.numel() * weight.element_size()
            else:
                sizes["coded"] += c.codes.numel()
                sizes["float32"] += weight.numel() * 4
        return seen[key]

    for model in models:
        if model is None:
            continue
        for module in model.modules():
            if isinstance(module, cpu_ops.Linear):
                module.codes = coded(module.weight, module.codes)
        if getattr(model, "vocab_head", None) is not None:
            model.vocab_codes = coded(model.vocab_head, getattr(model, "vocab_codes", None))
        for module in model.modules():
            if getattr(module, "parts", None):
                _stack(module)
    return sizes


def _stack(module: nn.Module) -> None:
    """`module.merged`: the codes of its projections of one input (`module.parts`) stacked into one
    product, when all have codes of one kind; each part's codes become a view of it (no second copy)."""
    layers = [getattr(module, name) for name in module.parts]
    codes = [m.codes for m in layers]
    if any(c is None for c in codes) or len({c.kind for c in codes}) > 1 or len({c.codes.shape[1] for c in codes}) > 1:
        module.merged = None
        return
    stacked = torch.cat([c.codes for c in codes])
    module.merged = Codes(codes[0].kind, stacked, 0)  # served only while every part's own codes are current
    at = 0
    for m, c in zip(layers, codes, strict=True):
        m.codes = c._replace(codes=stacked[at:at + len(c.codes)])
        at += len(c.codes)


def kinds(model: nn.Module | None) -> list[str]:
    """The kind of each product of `model` in module order ("float32" where uncoded)."""
    if model is None:
        return []
    layers = [m for m in model.modules() if isinstance(m, cpu_ops.Linear)]
    out = [m.codes.kind if m.codes is not None else "float32" for m in layers]
    if getattr(model, "vocab_head", None) is not None:
        codes = getattr(model, "vocab_codes", None)
        out.append(codes.kind if codes is not None else "float32")
    return out


def graph_key(model: nn.Module | None) -> str:
    """What compiled rounds of `model` depend on here: each product's kind (`kinds`) and which
    projections run as one stacked product."""
    stacked = ["stacked" if m.merged is not None else "apart" for m in model.modules() if getattr(m, "parts", None)] \
        if model is not None else []
    return ",".join(kinds(model) + stacked)


def watch(*models: nn.Module | None) -> list[tuple[torch.Tensor, int]]:
    """(weight, version) of every coded weight of `models`: compiled rounds read the codes without
    looking at the weight, so a Runtime checks these before each step (`changed`)."""
    out = [(m.weight, m.codes.version) for model in models if model is not None for m in model.modules()
           if isinstance(m, cpu_ops.Linear) and m.codes is not None]
    return out + [(m.vocab_head, m.vocab_codes.version) for m in models
                  if m is not None and getattr(m, "vocab_codes", None) is not None]


def changed(watched: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether any weight of `watch`'s list changed in place since it was coded."""
    return any(w._version != v for w, v in watched)
