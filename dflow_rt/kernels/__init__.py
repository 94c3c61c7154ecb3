"""The runtime's fused kernels: per op a torch reference and a Triton kernel of the same
signature (the attention also FlashInfer on CUDA), chosen once per Runtime by `select`."""

from dflow_rt.kernels.selection import IMPLEMENTATIONS, OPS, Kernels, implementation_for, select, select_for

__all__ = ["IMPLEMENTATIONS", "OPS", "Kernels", "implementation_for", "select", "select_for"]
