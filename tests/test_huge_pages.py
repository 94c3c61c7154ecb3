"""Weights moved into huge pages keep their values, their parameter objects and their ties."""

import mmap

import pytest
import torch
from torch import nn

from dflow_rt.models import huge_pages

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="needs Linux's MADV_HUGEPAGE")


def _pair():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50, bias=False), nn.Linear(8, 8).double())
    a[1].weight = a[0].weight  # tied, as a target's head and embedding
    b = nn.Sequential(nn.Linear(8, 8))
    b[0].weight = a[2].weight  # a parameter shared with the other model
    return a, b


def test_place_keeps_values_objects_and_ties(monkeypatch):
    monkeypatch.delenv("DFLOW_RT_HUGE_PAGES", raising=False)
    a, b = _pair()
    before = {id(p): (p, p.detach().clone(), p.requires_grad) for m in (a, b) for p in m.parameters()}
    assert huge_pages.place(a, b, min_bytes=0)
    for p, value, grad in before.values():
        assert torch.equal(p, value) and p.dtype == value.dtype and p.requires_grad == grad
    assert a[1].weight is a[0].weight and b[0].weight is a[2].weight
    assert {id(p) for m in (a, b) for p in m.parameters()} == set(before)
    spans = sorted((p.data_ptr(), p.numel() * p.element_size()) for p, _, _ in before.values())
    assert spans[0][0] % huge_pages.HUGE == 0  # the first weight starts a huge page
    for (start, size), (after, _) in zip(spans, spans[1:], strict=False):  # one copy each, none overlapping
        assert after >= start + size and after % 64 == 0
    assert not huge_pages.place(a, b, min_bytes=0)  # placed once
    out = a[2](torch.randn(3, 8, dtype=torch.float64))  # still ordinary, trainable parameters
    out.sum().backward()
    assert a[2].weight.grad is not None


def test_place_leaves_small_models_and_opt_out_alone(monkeypatch):
    a, b = _pair()
    ptr = a[0].weight.data_ptr()
    assert not huge_pages.place(a, b)  # below MIN_BYTES
    monkeypatch.setenv("DFLOW_RT_HUGE_PAGES", "0")
    assert not huge_pages.place(a, b, min_bytes=0)
    assert a[0].weight.data_ptr() == ptr
