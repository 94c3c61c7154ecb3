"""Small randomly initialised target + drafter directories, for smoke tests and demos.

They decode real (if meaningless) text through the whole stack until trained models ship.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflow_rt.models.checkpoint import save_model
from dflow_rt.models.drafter import Drafter, DrafterConfig, build_target_layer_ids
from dflow_rt.models.target import Target, TargetConfig
from dflow_rt.tokenizer import train_tokenizer


def init_random(out_dir: str | Path, seed: int = 0, hidden: int = 128, target_layers: int = 6,
                drafter_layers: int = 2, block_size: int = 16) -> tuple[Path, Path]:
    """Write `out_dir/target` (with a byte-level tokenizer) and `out_dir/drafter`."""
    out_dir = Path(out_dir)
    tokenizer = train_tokenizer([], vocab_size=256 + 4)
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    target = Target(TargetConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=target_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=True,
        max_position_embeddings=4096,
    ))
    drafter = Drafter(DrafterConfig(
        hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=drafter_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, vocab_size=vocab,
        block_size=block_size, mask_token_id=tokenizer.mask_token_id,
        target_layer_ids=tuple(build_target_layer_ids(target_layers, drafter_layers)),
        num_target_layers=target_layers, max_position_embeddings=4096,
    ))
    for model in (target, drafter):
        for name, p in model.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(p, std=0.02)
    target_dir = save_model(target, out_dir / "target")
    tokenizer.save_pretrained(target_dir)
    (target_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id}) + "\n")
    return target_dir, save_model(drafter, out_dir / "drafter")
