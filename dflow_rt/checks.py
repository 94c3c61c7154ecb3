"""Request checks shared by the Runtime and the reference round.

Everything a request carries is checked here, before it reaches a device: exact types (a count
is an int, never a float, bool or string; a prompt is one 1-D sequence of token ids) and ranges.
A bad request raises `InputError` naming the field, the value and the limit, so nothing it
carries can make a later round fail or silently mean something else.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from dflow_rt.errors import InputError

MAX_SEED = 2**63 - 1


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """`value` as an int in low..high (inclusive); floats, bools, strings and None are refused."""
    if not _is_int(value):
        raise InputError(f"{name} must be an int, got {_show(value)} ({type(value).__name__})")
    value = int(value)
    if value < low or (high is not None and value > high):
        limit = f">= {low}" if high is None else f"in {low}..{high}"
        raise InputError(f"{name} must be {limit}, got {value}")
    return value


def check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> float:
    """A finite real number in [low, high] (or (low, high]); bools and strings are refused."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InputError(f"{name} must be a number, got {_show(value)} ({type(value).__name__})")
    value = float(value)
    inside = (value > low if low_open else value >= low) and value <= high
    if not math.isfinite(value) or not inside:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise InputError(f"{name} must be finite and in {span}, got {value}")
    return value


def prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Token ids [1, P] (long, on `device`) from one 1-D list/tuple or integer tensor of ids."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1:
            raise InputError(f"prompt_ids must be a 1-D sequence of token ids, got a tensor of shape "
                             f"{tuple(prompt_ids.shape)}")
        if prompt_ids.is_floating_point() or prompt_ids.is_complex() or prompt_ids.dtype == torch.bool:
            raise InputError(f"prompt_ids must be integer token ids, got dtype {prompt_ids.dtype}")
        ids = prompt_ids.detach().to("cpu", torch.long)
    elif isinstance(prompt_ids, (list, tuple)):
        bad = next((x for x in prompt_ids if not _is_int(x)), None)
        if bad is not None or any(isinstance(x, bool) for x in prompt_ids):
            raise InputError(f"prompt_ids must be a 1-D sequence of int token ids, found {_show(bad)} "
                             f"({type(bad).__name__})")
        if any(abs(int(x)) > MAX_SEED for x in prompt_ids):
            raise InputError(f"prompt_ids must be integers in 0..{vocab_size - 1}")
        ids = torch.tensor([int(x) for x in prompt_ids], dtype=torch.long)
    else:
        raise InputError(f"prompt_ids must be a list, tuple or 1-D tensor of token ids, got "
                         f"{type(prompt_ids).__name__}")
    if ids.numel() == 0:
        raise InputError("prompt_ids is empty: at least one token is needed")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise InputError(f"prompt_ids must be integers in 0..{vocab_size - 1}, got {low if low < 0 else high}")
    return ids.to(device)[None]


def stop_set(stop_token_ids: Iterable[int] | None, vocab_size: int) -> frozenset[int]:
    """Stop ids as a set; a string or a non-integer id is refused rather than ignored."""
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
        raise InputError(f"stop_token_ids must be a sequence of token ids, got {_show(stop_token_ids)}")
    if isinstance(stop_token_ids, torch.Tensor):
        stop_token_ids = stop_token_ids.flatten().tolist()
    return frozenset(check_int("stop_token_ids[]", t, 0, vocab_size - 1) for t in stop_token_ids)


def check_fits(prompt_len: int, max_new_tokens: int, block_size: int, max_len: int) -> None:
    """The prompt, every new token and one block past them must fit the cache."""
    if prompt_len + max_new_tokens + block_size > max_len:
        raise InputError(f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} + block {block_size} "
                         f"does not fit max_len {max_len}")


@dataclass(frozen=True)
class Sampling:
    """Checked sampling settings: temperature 0 is greedy; top_k 0 and top_p 1 switch a filter off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


def check_sampling(temperature: object, top_k: object, top_p: object, seed: object, vocab_size: int) -> Sampling:
    """Sampling settings of a request; top_k beyond the vocabulary means the whole vocabulary."""
    t = check_float("temperature", temperature, 0.0, 1e6)
    k = min(check_int("top_k", top_k, 0), vocab_size)
    p = check_float("top_p", top_p, 0.0, 1.0, low_open=True)
    s = None if seed is None else check_int("seed", seed, 0, MAX_SEED)
    return Sampling(t, k, p, s)


def cut_at_stop(tokens: list[int], stops: frozenset[int] | set[int]) -> tuple[list[int], bool]:
    """`tokens` up to and including the first stop token, and whether one was found."""
    for i, tok in enumerate(tokens):
        if tok in stops:
            return tokens[:i + 1], True
    return tokens, False
