"""Top-p at exact probability ties: both samplers (the torch reference and the Triton kernel) keep
the tokens transformers' `TopPLogitsWarper` keeps.

The rule: a token is kept when the mass ranked strictly above it is below top_p, so a token whose
mass above equals top_p exactly is cut (transformers removes a token when the mass at or below it
is at most 1 - top_p). Equal logits make such ties exact: every distribution here is dyadic (each
probability a power of two), which float32 softmaxes and cumulative sums hold without rounding, and
top_p is set at every boundary between cumulative masses, and between them.

Equal logits are interchangeable: which of a tied group a cut keeps is the sort's choice (the two
sort in opposite directions), how many it keeps is the rule's. So the kept tokens are compared as
the multiset of their logits. What a sampler keeps is read from its draws on a grid of uniforms fine
enough to land on every kept token.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before its first launch); conftest
runs this file before any test that compiles with inductor in the same process.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from dflow_rt.kernels.sample import sample_torch, sample_triton
from dflow_rt.kernels.selection import importable

CUDA = torch.cuda.is_available()
if not CUDA:  # read when a kernel is first launched (kernels are decorated then), not at import
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cuda" if CUDA else "cpu"
LN2 = math.log(2)
SAMPLERS = [
    pytest.param(sample_torch, id="torch"),
    pytest.param(sample_triton, id="triton", marks=pytest.mark.skipif(
        not importable("triton"), reason="triton is not installed: the Triton sampler cannot run")),
]


def logits_of(halvings: list[float]) -> list[float]:
    """Logits whose softmax is proportional to 2 ** -h for each h (-inf: probability 0)."""
    return [-h * LN2 for h in halvings]


# (name, halvings per token, temperature); top_p runs over every boundary of each.
PATTERNS = [
    ("2 equal", [0, 0], 1.0),
    ("4 equal", [0] * 4, 1.0),
    ("8 equal", [0] * 8, 1.0),
    ("16 equal", [0] * 16, 1.0),
    ("4 equal, 3 impossible", [0, math.inf, 0, 0, math.inf, 0, math.inf], 1.0),
    ("a half, then 2 equal", [1, 0, 1], 1.0),
    ("a half, then 4 equal", [2, 2, 0, 2, 2], 1.0),
    ("2 equal on top, then 4 equal", [1, 1, 0, 1, 0, 1], 1.0),
    ("tied groups of 2, 2 and 4", [2, 1, 3, 2, 3, 1, 3, 3], 1.0),
    ("4 equal, temperature 0.5", [0] * 4, 0.5),
    ("a half, then 4 equal, temperature 0.5", [2, 2, 0, 2, 2], 0.5),
    ("2 equal on top, then 4 equal, temperature 2", [1, 1, 0, 1, 0, 1], 2.0),
]


def ties(probs: list[float]) -> list[float]:
    """Every cumulative mass of the distribution ranked high to low, below 1: the top_p values at
    which the mass above some token equals top_p exactly."""
    return sorted({sum(sorted(probs, reverse=True)[:i]) for i in range(1, len(probs))} - {1.0})


def boundaries(probs: list[float]) -> list[float]:
    """The ties and the midpoints around them."""
    cums = ties(probs)
    mids = [(a + b) / 2 for a, b in zip([0.0, *cums], [*cums, 1.0], strict=True)]
    return sorted(set(cums) | set(mids))


def warper_keeps(logits: torch.Tensor, temperature: float, top_p: float) -> list[float]:
    """transformers' choice, as the sorted logits of the tokens it keeps."""
    scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits[None].clone()))[0]
    return sorted(logits[torch.isfinite(scores)].tolist())


def grid(b: int, probs: list[float]) -> torch.Tensor:
    """Uniforms [b, n] at the midpoints of n equal steps, n = 1 / the smallest positive probability: a
    kept token holds at least that share of the kept mass, so one of them lands on it (and none on
    the edge between two tokens: the kept masses are dyadic, the midpoints odd multiples of 1 / 2n)."""
    n = round(1 / min(p for p in probs if p > 0))
    return ((torch.arange(n, dtype=torch.float64, device=DEV) + 0.5) / n).expand(b, n).contiguous()


def sampler_keeps(sampler, logits: torch.Tensor, probs: list[float], temperature: float,
                  top_ps: list[float]) -> list[list[float]]:
    """Per top_p, the sorted logits of the tokens `sampler` draws over the uniform grid (one batch
    row per top_p, one position per uniform); checks that it never draws an impossible token."""
    b, V = len(top_ps), logits.shape[0]
    u = grid(b, probs)
    rows = logits.to(DEV).expand(b, u.shape[1], V).contiguous()
    tokens = sampler(rows, torch.full((b,), temperature, device=DEV), torch.zeros(b, dtype=torch.long, device=DEV),
                     torch.tensor(top_ps, dtype=torch.float32, device=DEV), u).cpu()
    assert torch.isfinite(logits[tokens]).all()
    return [sorted(logits[sorted(set(row))].tolist()) for row in tokens.tolist()]


def dyadic(halvings: list[float], temperature: float) -> tuple[torch.Tensor, list[float]]:
    """The logits (scaled by the temperature that the samplers divide out again) and their exact
    probabilities; skips where this device's softmax does not give them exactly."""
    logits = torch.tensor(logits_of(halvings), dtype=torch.float32) * temperature
    weights = [2.0 ** -h for h in halvings]
    assert math.log2(sum(weights)).is_integer(), "a case whose probabilities are not powers of two"
    probs = [w / sum(weights) for w in weights]
    got = torch.softmax(logits.to(DEV) / temperature, dim=-1).cpu()
    if got.tolist() != probs:
        pytest.skip(f"this device's float32 softmax does not give {probs} exactly")
    return logits, probs


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("name, halvings, temperature", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_top_p_keeps_what_transformers_keeps_at_exact_ties(sampler, name, halvings, temperature):
    logits, probs = dyadic(halvings, temperature)
    top_ps = boundaries(probs)
    expected = [warper_keeps(logits, temperature, p) for p in top_ps]
    assert sampler_keeps(sampler, logits, probs, temperature, top_ps) == expected
    # the cases hold exact ties: at each, the token whose mass above equals top_p is cut, just above it kept
    assert ties(probs) and all(len(warper_keeps(logits, temperature, p)) + 1
                               == len(warper_keeps(logits, temperature, p + 1e-6)) for p in ties(probs))


@st.composite
def dyadic_distributions(draw):
    """A distribution made by halving cells of [1] in turn (every probability a power of two, some
    of them equal), with tokens shuffled and a few impossible ones."""
    cells = [0]
    for _ in range(draw(st.integers(1, 7))):
        i = draw(st.integers(0, len(cells) - 1))
        if cells[i] < 4:
            cells[i:i + 1] = [cells[i] + 1, cells[i] + 1]
    cells += [math.inf] * draw(st.integers(0, 2))
    return draw(st.permutations(cells)), draw(st.sampled_from([1.0, 0.5, 2.0]))


@pytest.mark.parametrize("sampler", SAMPLERS)
@settings(max_examples=10)
@given(dyadic_distributions())
def test_top_p_keeps_what_transformers_keeps_on_dyadic_distributions(sampler, case):
    halvings, temperature = case
    logits, probs = dyadic(halvings, temperature)
    top_ps = boundaries(probs)
    assert sampler_keeps(sampler, logits, probs, temperature, top_ps) == [warper_keeps(logits, temperature, p)
                                                                   for p in top_ps]


@pytest.mark.skipif(not importable("triton"), reason="triton is not installed: the Triton sampler cannot run")
def test_both_samplers_draw_the_same_tokens_at_ties():
    """At exact ties the two samplers draw token for token alike (the kernel uses torch's sort)."""
    logits, probs = dyadic([1, 1, 0, 1, 0, 2, 3, 3, math.inf], 1.0)
    top_ps = boundaries(probs)
    b = len(top_ps)
    u = grid(b, [p / 2 for p in probs])  # two draws per token's share
    rows = logits.to(DEV).expand(b, u.shape[1], -1).contiguous()
    args = (torch.ones(b, device=DEV), torch.zeros(b, dtype=torch.long, device=DEV),
            torch.tensor(top_ps, dtype=torch.float32, device=DEV), u)
    assert torch.equal(sample_triton(rows, *args), sample_torch(rows, *args))
