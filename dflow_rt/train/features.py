"""Cached target features: the frozen target's context pass over a sequence file, computed once.

A DFlash update reads the target only through its features at the conditioning layers over the
clean sequence, and those never change while the drafter trains. On a real target that pass is
most of an update's cost (SmolLM2-135M: ~200 MFLOP a token through 28 of its 30 layers, against a
few MFLOP for a 2-layer drafter), and every epoch would pay it again. `dflow-rt train features`
runs it once and stores the features in bfloat16, row-aligned with the sequence file's tokens;
`train dflash --features FILE` then never runs the target. DFlow rounds still run it online: their
verify pass needs the target's keys and values, which cost ~10x the features to keep.

File: safetensors with `features` bf16 [total tokens, K * hidden]; metadata `features` holds JSON
(target and data digests, layer ids) that a training run checks before trusting the file. With
`--topk K` the pass runs the whole target and the file also holds its next-token distribution's top K
at each position (`topk_ids` int32, `topk_probs` float32 [total tokens, K]): soft labels for
`train dflash --distill`, at about 1.3x the pass's cost.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflow_rt.errors import InputError
from dflow_rt.train.sequences import Sequences, file_digest, load_sequences, model_digest


def feature_meta(target_dir: Path, data: Path, layer_ids: tuple[int, ...], digests: dict | None = None) -> dict:
    digests = digests or {"target_digest": model_digest(target_dir), "data_digest": file_digest(data)}
    return {"target_digest": digests["target_digest"], "data_digest": digests["data_digest"],
            "layer_ids": list(layer_ids)}


@torch.inference_mode()
def write_features(target_dir: str | Path, data: str | Path, out: str | Path, layer_ids: tuple[int, ...],
                   tokens_per_batch: int = 4096, threads: int | None = None, device: str = "cpu",
                   topk: int = 0) -> Path:
    """Features of every sequence of `data` at `layer_ids` (the target's float32 pass, stored as bf16),
    and with `topk` the top `topk` tokens and probabilities of the target's softmax at each position.

    Sequences go in length order, several per pass (right padding cannot reach earlier positions
    of a causal pass), so the result equals one pass per sequence.
    """
    from tqdm import tqdm

    from dflow_rt.models.checkpoint import load_target
    from dflow_rt.train.objective import target_context

    target_dir, data, out = Path(target_dir), Path(data), Path(out)
    if threads:
        torch.set_num_threads(threads)
    target = load_target(target_dir, device=device)
    n_layers = target.config.num_hidden_layers
    if not layer_ids or any(not 0 <= i < n_layers for i in layer_ids):
        raise InputError(f"layer ids {list(layer_ids)}: the target has layers 0..{n_layers - 1}")
    seqs = load_sequences(data)
    lengths = seqs.lengths()
    total = int(seqs.offsets[-1])
    feats = torch.empty(total, len(layer_ids) * target.config.hidden_size, dtype=torch.bfloat16)
    soft = {"topk_ids": torch.empty(total, topk, dtype=torch.int32),
            "topk_probs": torch.empty(total, topk, dtype=torch.float32)} if topk else {}
    order = sorted(range(len(seqs)), key=lambda i: -int(lengths[i]))
    bar = tqdm(total=len(feats), unit="token", unit_scale=True, desc="features")
    k = 0
    while k < len(order):
        width = int(lengths[order[k]])
        rows = order[k:k + max(1, tokens_per_batch // width)]
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for j, i in enumerate(rows):
            ids[j, :int(lengths[i])] = seqs[i]
        if topk:
            pos = torch.arange(width, device=device).expand(len(rows), -1)
            logits, f = target(ids.to(device), pos, layer_ids=tuple(layer_ids))
            probs, top = logits.float().softmax(-1).topk(topk, dim=-1)
        else:
            f, _ = target_context(target, ids.to(device), tuple(layer_ids))
        for j, i in enumerate(rows):
            span, n = slice(int(seqs.offsets[i]), int(seqs.offsets[i + 1])), int(lengths[i])
            feats[span] = f[j, :n].to("cpu", torch.bfloat16)
            if topk:
                soft["topk_ids"][span], soft["topk_probs"][span] = top[j, :n].cpu(), probs[j, :n].cpu()
        bar.update(int(lengths[rows].sum()))
        k += len(rows)
    bar.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file({"features": feats, **soft}, str(tmp),
              metadata={"features": json.dumps(feature_meta(target_dir, data, tuple(layer_ids)))})
    tmp.replace(out)
    return out


def load_features(path: str | Path, target_dir: str | Path, data: str | Path, layer_ids: tuple[int, ...],
                  digests: dict | None = None) -> torch.Tensor:
    """The cached features, after checking they belong to this target, this data and these layers.
    `digests` (target_digest, data_digest) spares hashing the files again when the caller has them."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("features", "null"))
            feats = f.get_tensor("features") if meta else None
    except (OSError, ValueError) as err:
        raise InputError(f"--features {path}: unreadable ({err})") from None
    if meta is None:
        raise InputError(f"--features {path}: not written by `dflow-rt train features`")
    want = feature_meta(Path(target_dir), Path(data), tuple(layer_ids), digests)
    clash = [f"{k} {meta.get(k)} (this run: {v})" for k, v in want.items() if meta.get(k) != v]
    if clash:
        raise InputError(f"--features {path} was computed for another run: " + ", ".join(clash))
    return feats


def load_soft_labels(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids, topk_probs) of a features file written with `--topk`: row t is the target's
    distribution of the token at t + 1. Call after `load_features` has checked the file."""
    with safe_open(str(path), framework="pt") as f:
        if "topk_ids" not in f.keys():
            raise InputError(f"--features {path}: holds no soft labels; write it with `train features --topk K`")
        return f.get_tensor("topk_ids"), f.get_tensor("topk_probs")


def gather(feats: torch.Tensor, seqs: Sequences, rows: list[int], width: int) -> torch.Tensor:
    """[len(rows), width, ...] rows of a per-token tensor (features, soft labels), zero-padded like
    `anchors.collate`'s ids."""
    out = torch.zeros(len(rows), width, feats.shape[1], dtype=feats.dtype)
    for j, i in enumerate(rows):
        a, b = int(seqs.offsets[i]), int(seqs.offsets[i + 1])
        out[j, :b - a] = feats[a:b]
    return out
