"""Tiny random models shared by the tests: an HF reference and our copy of the same weights."""

from __future__ import annotations

from dataclasses import replace

import torch
import transformers

import dflow_rt
from dflow_rt.models.checkpoint import target_config
from dflow_rt.models.drafter import with_relay


def tiny_hf_target(seed: int, vocab: int = 16, hidden: int = 32, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, head_dim: int = 8, tied: bool = False, family: str = "qwen3"):
    """A random HF Qwen3/Llama model (fp32, eager attention) with logits sharp enough to avoid ties."""
    cls_cfg, cls_model = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    cfg = cls_cfg(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  tie_word_embeddings=tied, max_position_embeddings=512, attn_implementation="eager")
    torch.manual_seed(seed)
    model = cls_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model


def ours_from_hf(hf) -> dflow_rt.Target:
    config = target_config(hf.config.to_dict(), "hf")
    model = dflow_rt.Target(config)
    model.load_state_dict(hf.state_dict(), strict=False)
    return model.eval()


def tiny_drafter(target: dflow_rt.Target, seed: int, layers: int = 1, block_size: int = 16,
                 layer_ids: tuple[int, ...] = (0, 1)) -> dflow_rt.Drafter:
    t = target.config
    config = dflow_rt.DrafterConfig(
        hidden_size=t.hidden_size, intermediate_size=2 * t.hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=t.vocab_size, block_size=block_size,
        mask_token_id=t.vocab_size - 1, target_layer_ids=layer_ids, num_target_layers=t.num_hidden_layers,
    )
    torch.manual_seed(seed)
    drafter = dflow_rt.Drafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return drafter.eval()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int, stop_token_ids=(), suppress: int | None = None) -> list[int]:
    """Plain autoregressive greedy decoding, recomputing the whole sequence each step; `suppress`
    is a token never chosen (a drafter's mask token, which speculative decoding never emits)."""
    ids, out = list(prompt), []
    while len(out) < max_new_tokens:
        logits = hf(torch.tensor([ids])).logits[0, -1]
        if suppress is not None:
            logits[suppress] = float("-inf")
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        if tok in stop_token_ids:
            break
    return out


def random_relay(parent: dflow_rt.Drafter, relay_hidden: int = 32, seed: int = 0,
                 relay_input: str = "mask_embedding") -> dflow_rt.Drafter:
    """`parent` as a DFlow drafter whose relay has random non-zero weights (so that it changes drafts)."""
    drafter = with_relay(parent, relay_hidden, seed, relay_input)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in drafter.relay.parameters():
            p.normal_(0, 0.5)
    return drafter


def whole_block(drafter: dflow_rt.Drafter) -> dflow_rt.Drafter:
    """`drafter` (same weights, relay and draft vocabulary) with `draft_whole_block` set."""
    copy = dflow_rt.Drafter(replace(drafter.config, draft_whole_block=True))
    copy.load_state_dict(drafter.state_dict())
    copy.use_relay = drafter.use_relay
    copy.vocab_ids, copy.vocab_head, copy.vocab_codes = drafter.vocab_ids, drafter.vocab_head, drafter.vocab_codes
    w = drafter.fc.weight
    return copy.to(device=w.device, dtype=w.dtype).eval()


def fixed(**settings) -> dflow_rt.RuntimeConfig:
    """A RuntimeConfig with the fields the Runtime would otherwise choose per device fixed: eager
    rounds verifying the whole block, so that per-round figures match the reference round."""
    return dflow_rt.RuntimeConfig(**{"mode": "eager", "verify_width": None, **settings})


def poison(rt, row: int, beyond: int) -> None:
    """NaN keys in `row`'s context, which every attention reads (so its request fails at its next
    round), and at positions beyond..beyond+9, past it, where SDPA's mask gives them zero weight and
    0 * NaN is NaN: only cleaning the row keeps those from its next request."""
    for span in (slice(1, 3), slice(beyond, beyond + 10)):
        rt.state.target_cache.k[0][row, :, span] = float("nan")


def build_avx2(tmp_path, source, namespace: str):
    """`source` (a C++ kernel of `dflow_rt/models`) built for AVX2 as a library of its own, its ops
    defined under `namespace` rather than registered for dflow_rt's CPU dispatch: the other
    instruction set's code, run on an AVX-512 machine. Built by the kernels' own build (`cpu_ops.build`).
    Returns `torch.ops.<namespace>`."""
    import shutil

    from dflow_rt.kernels.cpu import ops as cpu_ops

    shutil.copy(cpu_ops.HEADER, tmp_path / cpu_ops.HEADER.name)  # what `#include "vec.h"` finds
    src = source.read_text().replace("TORCH_LIBRARY_IMPL(dflow_rt, CPU, m)", f"TORCH_LIBRARY({namespace}, m)")
    (tmp_path / f"{namespace}.cpp").write_text(src.replace("m.impl(", "m.def("))
    torch.ops.load_library(str(cpu_ops.build(namespace, [tmp_path / f"{namespace}.cpp"], tmp_path, isa="AVX2")))
    return getattr(torch.ops, namespace)


def scheduled_runtime(target, drafter, schedule, **settings) -> dflow_rt.Runtime:
    """A Runtime whose round policy picks the width that follows `schedule(round, widths)` instead of timings
    (`widths`: the bucket's, ascending: 1, half the block rounded up, the block); width 1 a plain step
    unless `lookup=True` is among `settings` (`tests/test_lookup.py`)."""
    config = dflow_rt.RuntimeConfig(max_batch=2, max_len=160, mode="eager", verify_width=None, ar_fallback=True,
                                    **{"lookup": False, **settings})
    rt = dflow_rt.Runtime(target, drafter, config)
    rounds = iter(range(10**6))
    rt.policy.width = lambda rows: schedule(next(rounds), rt.plan.round_widths(rows))
    return rt
