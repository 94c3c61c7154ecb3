"""Sequence files: the regenerated drafter training data on disk.

One safetensors file: `tokens` int32 [total] (every sequence, prompt then continuation, back to
back), `offsets` int64 [n + 1], `prompt_lens` int32 [n], `kinds` int8 [n]; its metadata key
`regen` holds JSON (settings, target digest, stop ids, kind names). A labelled file
(`dflow_rt.train.label`) also holds `truth` int32 [total]: the token the target writes at each
position after the text before it; in a regen file that is the text itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def file_digest(*paths: str | Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def model_digest(directory: str | Path) -> str:
    """Hash of a model directory's config and weights: a resumed run must see the same target."""
    return file_digest(Path(directory) / "config.json", *sorted(Path(directory).glob("*.safetensors")))


@dataclass
class Sequences:
    """Token sequences (prompt + continuation) of a regen file."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    prompt_lens: torch.Tensor
    kinds: torch.Tensor
    meta: dict
    truth: torch.Tensor | None = None  # labelled text: the target's own token at each position

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])].long()

    def truth_of(self, i: int) -> torch.Tensor:
        """What the drafter learns to predict at each position of sequence i."""
        src = self.tokens if self.truth is None else self.truth
        return src[int(self.offsets[i]):int(self.offsets[i + 1])].long()

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


def save_sequences(path: Path, seqs: list[list[int]], prompt_lens: list[int], kinds: list[int], meta: dict) -> None:
    """Write atomically (temp file + rename): an interrupted run never leaves a torn file."""
    lens = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.long)
    tensors = {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
               "offsets": lens.cumsum(0), "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
               "kinds": torch.tensor(kinds, dtype=torch.int8)}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata={"regen": json.dumps(meta)})
    tmp.replace(path)


def load_sequences(path: str | Path) -> Sequences:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["regen"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    return Sequences(t["tokens"], t["offsets"], t["prompt_lens"], t["kinds"], meta, t.get("truth"))
