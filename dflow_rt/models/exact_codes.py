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

Weights are held once: `attach` releases the float32 storage of every coded weight of a model in
eval mode (`ops.held`), so a coded SmolLM2 keeps its 0.1 GB of codes, not also 0.54 GB of float32.
Everything that reads values reads the codes: products (`ops.linear`, which decodes a weight for the
products the kernel does not serve, such as prefill's many rows), embeddings (`ops.Embedding`), the
state dict (`save_model` writes the decoded float32) and the draft vocabulary's head rows. `load_target`
codes a CPU float32 target as it loads, one weight at a time, so the whole float32 model is never
resident. A model in training mode keeps its float32 (codes beside it); `restore` gives a held model
its float32 storage back (to train it, or to change its weights in place).
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.kernels.cpu.ops import Codes
from dflow_rt.models import huge_pages

BLOCK = 32  # values per block along a row (the GGUF formats' block)
GROUP = cpu_ops.CODE_GROUP  # rows stored together; a weight's rows must be a multiple
LEVELS = {"u4": (0, 15), "i8": (-128, 127)}  # the range of q per kind
PROBE_ROWS = 64  # a weight is first tried on its first rows: float32 noise fails there, cheaply
CHUNK_ROWS = 1024  # rows coded at a time: coding's temporaries stay a few MB, not copies of a large weight


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
    return cpu_ops.decode(codes)


@torch.no_grad()
def encode(weight: torch.Tensor) -> Codes | None:
    """Exact codes of a float32 CPU weight [N, K] (N a multiple of GROUP, K of BLOCK), or None when it
    has none. Coded CHUNK_ROWS rows at a time, each chunk checked bit for bit."""
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0
            or weight.shape[1] % BLOCK or weight.shape[0] % GROUP or cpu_ops.held(weight) or not cpu_ops.enabled()):
        return None
    w = weight.detach()
    for kind in (*LEVELS, "b16"):
        parts = []
        for start in range(0, w.shape[0], CHUNK_ROWS):
            chunk = w[start:start + CHUNK_ROWS].contiguous()
            codes = _codes(chunk, chunk.reshape(chunk.shape[0], -1, BLOCK), kind, weight._version)
            if codes is None or not torch.equal(decode(codes).view(torch.int32), chunk.view(torch.int32)):
                break  # bit for bit, -0.0 included
            parts.append(codes.codes)
        else:
            return Codes(kind, parts[0] if len(parts) == 1 else torch.cat(parts), weight._version, weight.data_ptr())
    return None


def _coded_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (cpu_ops.Linear, cpu_ops.Embedding))]


def attach(*models: nn.Module | None) -> dict[str, int] | None:
    """Give every float32 product of `models` (`cpu_ops.Linear` layers, a drafter's draft-vocabulary
    head) and embedding table its exact codes where it has some, once per weight (a tied head is coded
    once), drop codes a changed weight no longer matches, and release the float32 storage of each
    coded weight of a model in eval mode as soon as it is coded (see the module docstring). Returns
    bytes a step streams: {"coded": as coded, "float32": the same weights as float32, "plain": weights
    left float32}; None when codes are off here (`enabled`) or nothing could have codes (no float32
    CPU weight: the kernel is not even built), after giving back the float32 of any weight held as its
    codes (`restore`)."""
    models = tuple(m for m in models if m is not None)
    candidates = any(p.device.type == "cpu" and p.dtype == torch.float32 for m in models for p in m.parameters())
    if not candidates or not enabled():
        restore(*models)
        return None
    placed = [m for m in models if huge_pages.placed(m)]
    sizes = {"coded": 0, "float32": 0, "plain": 0}
    released = False
    # each weight once (a tied table and head: one Parameter), heads before tables: a table's bytes are
    # not streamed by a step, so they are not counted
    owners: dict[int, tuple[torch.Tensor, list[nn.Module]]] = {}
    for kind in (cpu_ops.Linear, cpu_ops.Embedding):
        for model in models:
            for module in model.modules():
                if isinstance(module, kind):
                    owners.setdefault(id(module.weight), (module.weight, []))[1].append(module)
    for weight, modules in owners.values():
        codes = next((m.codes for m in modules if cpu_ops._current(m.codes, weight)), None) or encode(weight)
        product = isinstance(modules[0], cpu_ops.Linear)
        if product and codes is None:
            sizes["plain"] += weight.numel() * weight.element_size()
        elif product:
            sizes["coded"] += codes.codes.numel()
            sizes["float32"] += weight.numel() * 4
        if codes is not None and not cpu_ops.held(weight) and not any(m.training for m in modules):
            weight.data = placeholder(weight)  # the Parameter (and its ties) stays; its version too
            codes, released = codes._replace(ptr=weight.data_ptr(), version=weight._version), True
        for m in modules:
            m.codes = codes
    for model in models:
        head = getattr(model, "vocab_head", None)
        if head is None:
            continue
        old = getattr(model, "vocab_codes", None)
        codes = old if cpu_ops._current(old, head) else encode(head)
        if codes is None:
            sizes["plain"] += head.numel() * head.element_size()
        else:
            sizes["coded"] += codes.codes.numel()
            sizes["float32"] += head.numel() * 4
            if not cpu_ops.held(head) and not model.training:
                model.vocab_head = head = placeholder(head)
                codes, released = codes._replace(ptr=head.data_ptr(), version=head._version), True
        model.vocab_codes = codes
    for model in models:
        for module in model.modules():
            if getattr(module, "parts", None):
                _stack(module)
    if released:
        _leave_shared_storage(placed)
        trim()
    for model in models:  # a held weight is never moved into huge pages (`huge_pages.place` would copy
        if any(cpu_ops.held(p) for p in model.parameters()):  # its placeholder out to full size)
            huge_pages.settle(model)
    return sizes


def placeholder(weight: torch.Tensor) -> torch.Tensor:
    """What a weight held as its codes keeps: its shape, dtype and device over one NaN (`ops.held`).
    Never an inference tensor, whatever mode the Runtime is built in: the held weight's version is read."""
    with torch.inference_mode(False):
        return torch.full((1,), float("nan"), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def _leave_shared_storage(models: list[nn.Module]) -> None:
    """Copy the weights of placed `models` left float32 out of the mapping `huge_pages.place` moved
    every weight into, when they are a small part of it, so that the mapping is freed."""
    tensors = [p for m in models for p in m.parameters() if p.numel() and not cpu_ops.held(p)]
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in {id(t): t for t in tensors}.values():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    for group in by_storage.values():
        total, used = group[0].untyped_storage().nbytes(), sum(t.numel() * t.element_size() for t in group)
        if used < total // 2:
            for t in group:
                t.data = t.data.clone()


def trim() -> None:
    """Hand memory freed inside the C heap back to the system (glibc's `malloc_trim`; elsewhere nothing)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def restore(*models: nn.Module | None) -> None:
    """Give every weight of `models` held as its codes its float32 storage back (decoded: the same
    values), and drop all their codes: a model to train, or to change in place, after a Runtime."""
    for model in (m for m in models if m is not None):
        for module in _coded_modules(model):
            if cpu_ops.held(module.weight) and module.codes is not None:
                module.weight.data = decode(module.codes)
        for module in _coded_modules(model):
            module.codes = None
        for module in model.modules():
            if getattr(module, "parts", None):
                module.merged = None
        if getattr(model, "vocab_head", None) is not None and cpu_ops.held(model.vocab_head):
            model.vocab_head = decode(model.vocab_codes)
        if getattr(model, "vocab_codes", None) is not None:
            model.vocab_codes = None


def _stack(module: nn.Module) -> None:
    """`module.merged`: the codes of its projections of one input (`module.parts`) stacked into one
    product, when all have codes of one kind; each part's codes become a view of it (no second copy)."""
    layers = [getattr(module, name) for name in module.parts]
    codes = [m.codes for m in layers]
    if module.merged is not None and all(c is not None and c.codes._base is module.merged.codes for c in codes):
        return  # stacked already
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
    """What compiled rounds of `model` depend on here: each product's kind (`kinds`), which projections
    run as one stacked product, and which tables and products read their codes for every value (held)."""
    if model is None:
        return ""
    stacked = ["stacked" if m.merged is not None else "apart" for m in model.modules() if getattr(m, "parts", None)]
    tables = [m.codes.kind if m.codes is not None else "float32" for m in model.modules()
              if isinstance(m, cpu_ops.Embedding)]
    weights = [m.weight for m in _coded_modules(model)] + [t for t in [getattr(model, "vocab_head", None)]
                                                           if t is not None]
    held = ["held" if cpu_ops.held(w) else "kept" for w in weights]
    return ",".join(kinds(model) + stacked + tables + held)


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
