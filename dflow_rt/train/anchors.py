"""Anchor batches for drafter training: which sequences and which block starts each update sees.

Batch `index` of `epoch` (and its anchors) is a pure function of the seed and the position, so a
run resumes exactly and any number of ranks sees the same global batches.
"""

from __future__ import annotations

import torch

from dflow_rt.data.synth import stable_unit
from dflow_rt.errors import InputError
from dflow_rt.train.features import gather
from dflow_rt.train.sequences import Sequences


def collate(seqs: Sequences, rows: list[int], anchors: int, span: int, B: int, keys: list[str]):
    """(ids [b, L] zero-padded, lengths [b], starts [b, N], ok [b, N]) with up to `anchors` distinct random
    anchors per row in its continuation (p >= prompt length, p + span <= length, else p + B <= length),
    drawn from a generator seeded by the row's key alone."""
    ids = [seqs[i] for i in rows]
    out = torch.zeros(len(rows), max(map(len, ids)), dtype=torch.long)
    starts, ok = torch.zeros(len(rows), anchors, dtype=torch.long), torch.zeros(len(rows), anchors, dtype=torch.bool)
    for j, (i, seq) in enumerate(zip(rows, ids, strict=True)):
        out[j, :len(seq)] = seq
        lo, n = int(seqs.prompt_lens[i]), len(seq)
        count = n - span - lo + 1 if n - span >= lo else n - B - lo + 1
        starts[j] = lo
        if count > 0:
            gen = torch.Generator().manual_seed(int(stable_unit(keys[j]) * 2**62))
            pick = torch.randperm(count, generator=gen)[:anchors]
            starts[j, :len(pick)], ok[j, :len(pick)] = lo + pick, True
    return out, torch.tensor([len(s) for s in ids]), starts, ok


def pad_truth(seqs: Sequences, rows: list[int], width: int) -> torch.Tensor:
    """[len(rows), width] labels of `rows` (`Sequences.truth_of`), zero-padded like `collate`'s ids."""
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for j, i in enumerate(rows):
        t = seqs.truth_of(i)
        out[j, :len(t)] = t
    return out


class AnchorBatches:
    """Global batches of sequences: batch `index` of `epoch` (and its anchors) is the same for any world
    size; rank r takes rows r*b..(r+1)*b. The position alone is the state, so resume is exact.
    A batch is a dict: ids, lengths, starts, ok (`collate`), for labelled text the target's own tokens as
    "truth", plus the rows of each `per_token` tensor (aligned with the file's tokens) under its own name:
    the cached target features (`dflow_rt.train.features`) as "feats", soft labels as "soft_ids"/"soft_probs"."""

    def __init__(self, seqs: Sequences, indices: list[int], global_batch: int, anchors: int, block: int,
                 rounds: int, seed: int, rank: int = 0, world: int = 1,
                 per_token: dict[str, torch.Tensor] | None = None):
        if global_batch % world or len(indices) < global_batch:
            raise InputError(f"global batch {global_batch}: needs {world} equal ranks and at least that many "
                             f"training sequences (have {len(indices)})")
        self.seqs, self.indices, self.global_batch, self.anchors = seqs, indices, global_batch, anchors
        self.block, self.span, self.seed, self.rank = block, block * rounds, seed, rank
        self.per_rank, self.per_token = global_batch // world, per_token or {}
        self.epoch, self.index, self._order = 0, 0, None

    def next(self):
        if self._order is None or self._order[0] != self.epoch:
            gen = torch.Generator().manual_seed(int(stable_unit(f"drafter:{self.seed}:{self.epoch}") * 2**62))
            self._order = (self.epoch, torch.randperm(len(self.indices), generator=gen).tolist())
        first = self.index * self.global_batch + self.rank * self.per_rank
        rows = [self.indices[k] for k in self._order[1][first:first + self.per_rank]]
        keys = [f"anchors:{self.seed}:{self.epoch}:{self.index}:{first + j}" for j in range(len(rows))]
        batch = collate(self.seqs, rows, self.anchors, self.span, self.block, keys)
        self.index += 1
        if (self.index + 1) * self.global_batch > len(self.indices):  # the epoch's last partial batch is skipped
            self.epoch, self.index = self.epoch + 1, 0
        out = dict(zip(("ids", "lengths", "starts", "ok"), batch, strict=True))
        for name, tensor in self.per_token.items():
            out[name] = gather(tensor, self.seqs, rows, batch[0].shape[1])
        if self.seqs.truth is not None:
            out["truth"] = pad_truth(self.seqs, rows, batch[0].shape[1])
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
