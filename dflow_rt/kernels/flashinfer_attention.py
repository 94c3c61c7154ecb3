"""Both block attentions through FlashInfer's paged prefill kernels (CUDA, fp16/bf16, head dim
64/128/256).

The static cache maps onto FlashInfer's paged layout with no copy: each row of a cache view
[rows, kv_heads, L, d] is one page of `page_size = L` in the HND layout (FlashInfer reads
the page stride, so the views' spare position is harmless), and row r holds start[r] + B
valid keys. With the block's B queries last in that range, FlashInfer's causal mask (query
i sees keys up to kv_len - B + i) is verify's mask, and no mask is the drafter's.

FlashInfer plans on the host: `plan` must run before each round (never inside a captured
graph or compiled code), with `starts` the host's copy of the device's `start` (a Runtime
knows each row's position without reading the device). Wrappers use CUDA graph mode (fixed
batch, preallocated index buffers), one per (rows, length, causal): a captured round replays
with the index buffers its own wrapper refills.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping, Sequence

import torch

HEAD_DIMS = (64, 128, 256)
SERVED_DTYPES = (torch.float16, torch.bfloat16)  # what FlashInfer's attention takes
_instances: weakref.WeakValueDictionary[int, FlashInferAttention] = weakref.WeakValueDictionary()  # by id
_ids = itertools.count()


def plan_inputs(starts: Sequence[int], block: int, length: int) -> tuple[torch.Tensor, ...]:
    """(qo_indptr, kv_indptr, kv_indices, kv_last_page_len), int32 on the host: row r is page r,
    its B queries follow each other, and its keys are positions 0 .. starts[r] + B - 1."""
    rows = len(starts)
    last = torch.tensor(starts, dtype=torch.int32) + block
    if rows == 0 or int(last.min()) < 1 or int(last.max()) > length:
        raise ValueError(f"every start + block ({block}) must lie in 1..{length}, got starts {list(starts)}")
    qo = torch.arange(0, (rows + 1) * block, block, dtype=torch.int32)
    return qo, torch.arange(rows + 1, dtype=torch.int32), torch.arange(rows, dtype=torch.int32), last


class FlashInferAttention:
    """A callable with `attention_torch`'s signature; the lengths come from the last `plan`, not
    from `start` (a device tensor the host would have to read)."""

    def __init__(self, workspace_bytes: int = 128 << 20):
        self.workspace_bytes = workspace_bytes
        self.shapes: dict[bool, tuple[int, int, int, torch.dtype]] = {}  # causal -> heads, kv_heads, d, dtype
        self.wrappers: dict[tuple[int, int, bool], object] = {}
        self.workspace: torch.Tensor | None = None
        self.id = next(_ids)
        _instances[self.id] = self

    def configure(self, causal: bool, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Declare the model attending with `causal` (verify's target: True, the drafter: False)."""
        if dtype not in SERVED_DTYPES or head_dim not in HEAD_DIMS:
            raise ValueError(f"FlashInfer attention needs fp16/bf16 and head_dim in {HEAD_DIMS}, "
                             f"got {dtype} and {head_dim}")
        self.shapes[causal] = heads, kv_heads, head_dim, dtype

    def configure_models(self, target, drafter) -> None:
        """`configure` for a target (verify) and a drafter (None: no draft attention)."""
        for causal, model, weight in ((True, target, target.lm_head.weight),
                                      (False, drafter, None if drafter is None else drafter.fc.weight)):
            if model is not None:
                c = model.config
                self.configure(causal, c.num_attention_heads, c.num_key_value_heads, c.head_dim, weight.dtype)

    def plan(self, rows: int, length: int, starts: Sequence[int], blocks: Mapping[bool, int],
             device: torch.device) -> None:
        """Plan the next round of the (rows, length) bucket for every configured attention;
        `blocks[causal]`: its queries per row (verify's width, the drafter's block size)."""
        import flashinfer

        if self.workspace is None:
            self.workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
        for causal, (heads, kv_heads, head_dim, dtype) in self.shapes.items():
            inputs, key = plan_inputs(starts, blocks[causal], length), (rows, length, causal)
            if key not in self.wrappers:
                buffers = [t.to(device) for t in inputs]
                self.wrappers[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "HND", use_cuda_graph=True, qo_indptr_buf=buffers[0],
                    paged_kv_indptr_buf=buffers[1], paged_kv_indices_buf=buffers[2],
                    paged_kv_last_page_len_buf=buffers[3])
            self.wrappers[key].plan(*inputs, heads, kv_heads, head_dim, length, causal=causal,
                                    q_data_type=dtype, kv_data_type=dtype)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                 causal: bool) -> torch.Tensor:
        return _run(q, k, v, causal, self.id)


@torch.library.custom_op("dflow_rt::flashinfer_attention", mutates_args=())
def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, planner: int) -> torch.Tensor:
    """Opaque to torch.compile (FlashInfer's wrappers are not traceable); capturable in a CUDA graph."""
    b, heads, B, d = q.shape
    wrapper = _instances[planner].wrappers[b, k.shape[2], causal]
    out = wrapper.run(q.transpose(1, 2).reshape(b * B, heads, d), (k, v))
    return out.view(b, B, heads, d).transpose(1, 2)


@_run.register_fake
def _(q, k, v, causal, planner):
    b, heads, B, d = q.shape
    return q.new_empty(b, B, heads, d).transpose(1, 2)
