"""Draft vocabulary: the drafter proposes only tokens its target actually writes.

A drafter scores its drafts with the target's vocabulary head, and on CPU that head is most of a
draft pass: SmolLM2's 49,152 x 576 float32 head is read from memory whole on every pass (about
43 ms on one EPYC core, whether for 3 rows or 15), where its 8,192 most used rows take about 6 ms.
The target's greedy continuations of the training prompts use a few thousand distinct tokens, so
a drafter restricted to the most frequent ones rarely loses a draft it would have got right
(ranking a draft vocabulary by frequency is FR-Spec's idea, Zhao et al. 2025).

Lossless by construction: the target still verifies every draft over its whole vocabulary, and a
token outside the set is emitted as the target's own choice; it is only never drafted.

The set lives beside the drafter's weights as `draft_vocab.json` (token ids in increasing order);
`load_drafter` uses it when present (`draft_vocab=False` keeps the whole vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflow_rt.errors import CheckpointError, InputError
from dflow_rt.models.bounds import MAX_JSON_BYTES, regular_file

FILE = "draft_vocab.json"


def build_draft_vocab(sequences, vocab_size: int, size: int,
                      rows: list[int] | None = None) -> tuple[torch.Tensor, float]:
    """The `size` most frequent tokens of regen `sequences` (prompts and continuations: a code
    continuation copies the prompt's identifiers), in increasing id order, and the share of the
    continuation tokens (what the drafter predicts) that they cover. `rows`: count these sequences only."""
    if not 1 <= size <= vocab_size:
        raise InputError(f"draft vocabulary size must be in 1..{vocab_size} (the vocabulary), got {size}")
    rows = range(len(sequences)) if rows is None else rows
    whole = [sequences.truth_of(i) for i in rows]  # labelled text: what the target writes there, not the text
    tokens = torch.cat(whole) if whole else torch.zeros(0, dtype=torch.long)
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise InputError(f"the data holds token id {int(tokens.max())}, outside the vocabulary of {vocab_size}")
    counts = torch.bincount(tokens, minlength=vocab_size)
    # most frequent first; a stable sort breaks ties (unseen tokens too) by id, which in a BPE
    # vocabulary roughly follows how common a token was when the tokenizer was built
    ids = torch.argsort(-counts, stable=True)[:size].sort().values
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    written = torch.cat([w[int(sequences.prompt_lens[i]):] for i, w in zip(rows, whole, strict=True)]) if whole \
        else tokens
    coverage = float(inside[written].float().mean()) if len(written) else 1.0
    return ids, coverage


def save_draft_vocab(directory: str | Path, ids: torch.Tensor, **info) -> Path:
    path = Path(directory) / FILE
    path.write_text(json.dumps({**info, "size": len(ids), "token_ids": ids.tolist()}) + "\n")
    return path


def load_draft_vocab(directory: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The drafter directory's draft vocabulary, or None when it has none."""
    path = Path(directory) / FILE
    if not path.exists():
        return None
    regular_file(path, MAX_JSON_BYTES)
    try:
        ids = torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.long)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        raise CheckpointError(path, f"unreadable draft vocabulary ({type(err).__name__})") from None
    if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= vocab_size \
            or len(ids.unique()) != len(ids):
        raise CheckpointError(path, f"'token_ids' must be distinct token ids of the target's vocabulary "
                                    f"(0..{vocab_size - 1})")
    return ids.sort().values
