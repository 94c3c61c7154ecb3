"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm layer.

Semantics of `models.layers.RMSNorm`: normalise in fp32, round to the input dtype, scale by
the weight (the product in the promoted dtype). With `residual`, the input is first x +
residual (rounded to the input dtype, as torch adds half-precision tensors) and both the
normed value and that sum come back, so a decoder layer reads its hidden state once per norm.
"""

from __future__ import annotations

from typing import Any

import torch

from dflow_rt.kernels.backend import triton_kernel

tl: Any = None  # triton.language, bound on the first launch (backend.triton_kernel)


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """normed, or (normed, x + residual) when `residual` is given."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return normed if residual is None else (normed, h)


def _rmsnorm_kernel(x, residual, weight, out, summed, D, eps, x_stride, r_stride, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    h = tl.load(x + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual + row * r_stride + cols, mask=ok, other=0.0).to(tl.float32)
        h = h.to(x.dtype.element_ty)  # the sum in the input dtype, as torch rounds it
        tl.store(summed + row * D + cols, h, mask=ok)
        h = h.to(tl.float32)
    normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    normed = normed.to(x.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row * D + cols, (w * normed).to(out.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    r2 = residual.reshape(-1, D).contiguous() if residual is not None else x2
    triton_kernel(_rmsnorm_kernel)[(x2.shape[0],)](
        x2, r2, weight.contiguous(), out, summed, D, eps, x2.stride(0), r2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_D=max(16, 1 << (D - 1).bit_length()))
    return out, summed


@torch.library.custom_op("dflow_rt::rmsnorm", mutates_args=())
def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, weight, eps, None)[0]


@_rmsnorm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("dflow_rt::add_rmsnorm", mutates_args=())
def _add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, weight, eps, residual)


@_add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), x.new_empty(x.shape)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`rmsnorm_torch` in one launch, one program per row of the last axis."""
    return _rmsnorm(x, weight, eps) if residual is None else _add_rmsnorm(x, residual, weight, eps)
