"""Offline corpora and the packed token stream for pretraining.

Three sources, all deterministic and available without a network: the running interpreter's
standard library sources, generated arithmetic word problems and chat exchanges about Python
objects (`synth`). Each is split into train / held-out by a stable hash, so held-out suites for
later evaluation never reach training. The stream is a pure function of (seed, epoch, batch
index): a run resumes by position, and any number of ranks sees the same global batches.
"""

from __future__ import annotations

import os
import random
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from dflow_rt.data.synth import (
    MATH_CHAT_PER_EPOCH,
    MATH_HELDOUT_START,
    MATH_PER_EPOCH,
    MATH_TRAIN_SEEDS,
    doc_chat,
    doc_items,
    heldout_math_problems,
    heldout_phrasing,
    math_chat,
    math_problem,
    math_text,
    math_train_problems,
    render_chat,
    stable_unit,
)

__all__ = ["MATH_HELDOUT_START", "MATH_TRAIN_SEEDS", "Mix", "PackedStream", "epoch_documents", "eval_windows",
           "heldout_chat_prompts", "heldout_math_prompts", "math_problem", "stdlib_files", "tokenizer_sample"]

STDLIB_HELDOUT_FRACTION = 0.02
EXCLUDED_PARTS = frozenset({"test", "tests", "idlelib", "site-packages"})
MATH_CHAT_OFFSET = 500_000  # chat-form problems start half-way through the training seeds


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=4)
def stdlib_files(split: str = "train") -> tuple[str, ...]:
    """Relative paths of the stdlib *.py files of `split` ("train" or "heldout"), sorted."""
    root, paths = stdlib_root(), []
    for folder, dirs, files in os.walk(root):  # pruned walk: site-packages alone can be huge
        dirs[:] = [d for d in dirs if d not in EXCLUDED_PARTS]
        rel = Path(folder).relative_to(root)
        paths += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    paths.sort()
    return tuple(p for p in paths if (stable_unit("stdlib:" + p) < STDLIB_HELDOUT_FRACTION) == (split == "heldout"))


def read_stdlib(rel: str) -> str:
    return (stdlib_root() / rel).read_bytes().decode("utf-8", errors="replace")


def heldout_chat_prompts() -> list[str]:
    """User turns of the held-out chat suite (questions about C-implemented Python objects); wrap them
    with the tokenizer's chat template to prompt. None of these items is ever trained on."""
    return [doc_chat(it, heldout_phrasing(it))[0]["content"] for it in doc_items() if it.heldout]


def heldout_math_prompts(n: int = 200) -> list[str]:
    """Questions of the held-out math suite (seeds >= MATH_HELDOUT_START, held-out question hash)."""
    return [q for q, _ in heldout_math_problems(n)]


@dataclass(frozen=True)
class Mix:
    """What one epoch holds: every training stdlib file and chat item once, plus fresh math problems."""

    math_docs: int = MATH_PER_EPOCH  # plain-text problems per epoch
    math_chats: int = MATH_CHAT_PER_EPOCH  # problems in chat form per epoch
    max_files: int | None = None  # a stdlib subset, for smoke tests


def _math_docs(epoch: int, mix: Mix) -> list[str]:
    plain = [math_text(q, a) for q, a in math_train_problems(epoch * mix.math_docs, mix.math_docs)]
    chats = math_train_problems(MATH_CHAT_OFFSET + epoch * mix.math_chats, mix.math_chats)
    return plain + [render_chat(math_chat(q, a)) for q, a in chats]


def _doc_chats(epoch: int, seed: int) -> list[str]:
    r = random.Random(f"{seed}:{epoch}:chat")
    return [render_chat(doc_chat(it, r.randrange(1 << 16))) for it in doc_items() if not it.heldout]


def epoch_documents(epoch: int, seed: int, mix: Mix = Mix()) -> list[str]:
    """All training documents of `epoch` in training order (the order is shuffled per epoch)."""
    docs = [read_stdlib(p) for p in stdlib_files("train")[:mix.max_files]]
    docs += _math_docs(epoch, mix) + _doc_chats(epoch, seed)
    random.Random(f"{seed}:{epoch}:order").shuffle(docs)
    return docs


def tokenizer_sample(max_chars: int = 3_000_000) -> list[str]:
    """Training text for the BPE: about 75 % stdlib (files in hash order), 15 % math, 10 % chat."""
    out, used = [], 0
    for rel in sorted(stdlib_files("train"), key=lambda p: stable_unit("sample:" + p)):
        if used >= 0.75 * max_chars:
            break
        out.append(read_stdlib(rel))
        used += len(out[-1])
    start = 0
    while used < 0.9 * max_chars:
        for text in _math_docs(start, Mix(math_docs=500, math_chats=250)):
            out.append(text)
            used += len(text)
        start += 1
    for text in _doc_chats(0, 0):
        if used >= max_chars:
            break
        out.append(text)
        used += len(text)
    return out


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _pack(tokenizer, docs: list[list[int]]) -> torch.Tensor:
    """Documents joined into one stream, each followed by <|endoftext|>."""
    eos = tokenizer.eos_token_id
    return torch.tensor([t for doc in docs for t in (*doc, eos)], dtype=torch.long)


def _windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Windows of seq_len + 1 tokens at stride seq_len: every token is a label exactly once."""
    n = (len(stream) - 1) // seq_len
    return stream[:n * seq_len + 1].unfold(0, seq_len + 1, seq_len) if n else stream.new_zeros(0, seq_len + 1)


class PackedStream:
    """Global batches of packed windows: batch `index` of `epoch` is the same for any world size; rank
    `r` gets rows r*B..(r+1)*B of it (B = global_batch // world)."""

    def __init__(self, tokenizer, seq_len: int, global_batch: int, seed: int, mix: Mix = Mix(),
                 rank: int = 0, world: int = 1):
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} does not split over {world} ranks")
        self.tokenizer, self.seq_len, self.global_batch = tokenizer, seq_len, global_batch
        self.seed, self.mix = seed, mix
        self.rank, self.per_rank = rank, global_batch // world
        self.epoch, self.index = 0, 0
        self._stdlib: list[list[int]] | None = None
        self._built: int | None = None

    def _build(self, epoch: int) -> None:
        """Tokenise an epoch (stdlib tokens once per process: they do not change between epochs)."""
        if self._stdlib is None:
            files = stdlib_files("train")[:self.mix.max_files]
            self._stdlib = _encode(self.tokenizer, [read_stdlib(p) for p in files])
        docs = self._stdlib + _encode(self.tokenizer, _math_docs(epoch, self.mix) + _doc_chats(epoch, self.seed))
        random.Random(f"{self.seed}:{epoch}:order").shuffle(docs)
        self.windows = _windows(_pack(self.tokenizer, docs), self.seq_len)
        gen = torch.Generator().manual_seed(int(stable_unit(f"windows:{self.seed}:{epoch}") * 2**62))
        self.order = torch.randperm(len(self.windows), generator=gen)
        self.batches_per_epoch = len(self.windows) // self.global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(f"an epoch has {len(self.windows)} windows, fewer than one global batch")
        self._built = epoch

    def next(self) -> torch.Tensor:
        """This rank's rows [per_rank, seq_len + 1] of the next global batch; advances the position."""
        if self._built != self.epoch:
            self._build(self.epoch)
        start = self.index * self.global_batch + self.rank * self.per_rank
        rows = self.windows[self.order[start:start + self.per_rank]]
        self.index += 1
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return rows

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def eval_windows(tokenizer, seq_len: int, per_source: int = 32) -> dict[str, torch.Tensor]:
    """Fixed held-out windows per source (evenly spaced over the held-out stream), for held-out loss."""
    docs = {
        "stdlib": [read_stdlib(p) for p in stdlib_files("heldout")],
        "math": [math_text(q, a) for q, a in heldout_math_problems(per_source * seq_len // 40)],
        "chat": [render_chat(doc_chat(it, heldout_phrasing(it))) for it in doc_items() if it.heldout],
    }
    out = {}
    for name, texts in docs.items():
        w = _windows(_pack(tokenizer, _encode(tokenizer, texts)), seq_len)
        out[name] = w[torch.linspace(0, len(w) - 1, min(per_source, len(w))).long()] if len(w) else w
    return out
