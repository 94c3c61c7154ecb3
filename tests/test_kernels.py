"""Every fused kernel against its torch reference, property-based; which implementation serves each op.

On CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports triton); with CUDA they run compiled, bf16 included. Integer outputs must
match exactly, floating ones within TOL of their dtype. Without triton only the tests that
launch a Triton kernel are skipped: selection, planning and the torch references still run.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflow_rt import Runtime
from dflow_rt.errors import InputError
from dflow_rt.kernels import implementation_for, select, selection
from dflow_rt.kernels.attention import attention_torch, attention_triton, cache_mask
from dflow_rt.kernels.commit import commit_torch, commit_triton
from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.kernels.flashinfer_attention import FlashInferAttention, plan_inputs
from dflow_rt.kernels.sample import sample_torch, sample_triton
from dflow_rt.kernels.sampling import uniform
from tests.conftest import FIXTURES, load_pair
from tests.helpers import fixed

CUDA = torch.cuda.is_available()  # without it, the kernels run in Triton's interpreter (tests/conftest.py)
TRITON = selection.importable("triton")
needs_triton = pytest.mark.skipif(not TRITON, reason="triton is not installed: this test launches a Triton kernel")

DEV = "cuda" if CUDA else "cpu"
FLOATS = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # atol = rtol
GPU_PROFILE = os.environ.get("HYPOTHESIS_PROFILE") == "gpu"


def examples(n: int) -> settings:
    """n examples per test on CPU (the interpreter is slow); the gpu profile's own count there."""
    return settings(max_examples=settings().max_examples if GPU_PROFILE else n)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def generator(seed: int) -> torch.Generator:
    return torch.Generator(DEV).manual_seed(seed)


# --- commit -------------------------------------------------------------------------------


@st.composite
def rounds(draw):
    """Verified blocks (k of B slots) with chosen acceptances (none, all, in between), state to carry."""
    rows, B = draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 3, 8, 16]))
    k = draw(st.sampled_from([B, draw(st.integers(1, B))]))
    accepted = draw(st.lists(st.integers(0, k - 1), min_size=rows, max_size=rows))
    g, V = generator(draw(st.integers(0, 2**16))), 7
    verified = torch.randint(0, V, (rows, k), generator=g, device=DEV)
    block = torch.randint(0, V, (rows, k), generator=g, device=DEV)
    for r, a in enumerate(accepted):
        block[r, 1:a + 1] = verified[r, :a]
        if a + 1 < k:
            block[r, a + 1] = (verified[r, a] + 1) % V
    flags = [torch.tensor(draw(st.lists(st.booleans(), min_size=rows, max_size=rows)), device=DEV) for _ in "fa"]
    feat, relay = draw(st.sampled_from(FLOATS)), draw(st.sampled_from([None, *FLOATS]))
    F = draw(st.sampled_from([1, 24, 300]))

    def ints(high):
        return torch.randint(0, high, (rows,), generator=g, device=DEV)

    state = dict(tokens=ints(V), start=ints(900), ctx_start=ints(900), fresh=flags[0], active=flags[1],
                 out=torch.full((rows + 1, B + 2), -1, dtype=torch.long, device=DEV)[:rows])
    if relay is not None:  # row views of a larger buffer, as a batch bucket's
        state.update(relay_features=torch.randn(rows + 1, B, F, generator=g, device=DEV).to(relay)[:rows],
                     relay_accepted=ints(B), relay_bonus=ints(V), relay_rejected=ints(V), relay_width=ints(B))
    features = torch.randn(rows, k, F, generator=g, device=DEV).to(feat)
    return block, verified, features if relay is not None else None, state


@needs_triton
@examples(80)
@given(rounds())
def test_commit_matches_reference(case):
    block, verified, features, state = case
    expected = {k: v.clone() for k, v in state.items()}
    commit_torch(block, verified, features, **expected)
    commit_triton(block, verified, features, **state)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


# --- sample -------------------------------------------------------------------------------


def decision_margin(logits, temperature, top_k, top_p, u) -> torch.Tensor:
    """[b, n]: how far the reference's decisions (the top-p cut, the CDF step picked) lie from
    flipping, relative to the mass; kernel and reference may round sums differently below it."""
    t = temperature.clamp(min=1e-6)[:, None, None]
    probs = torch.sort(torch.softmax(logits.float() / t, dim=-1), dim=-1, descending=True)[0].double()
    rank = torch.arange(logits.shape[-1], device=logits.device)
    probs = probs * (rank < torch.where(top_k > 0, top_k, logits.shape[-1])[:, None, None])
    probs = probs / probs.sum(-1, keepdim=True)
    before = probs.cumsum(-1) - probs
    # Where a token's inclusion could flip; tokens lighter than the margin hardly move the CDF.
    cut = torch.where(probs > 1e-5, (before - top_p[:, None, None].double()).abs(), torch.inf).amin(-1)
    cdf = (probs * ((before < top_p[:, None, None]) | (rank == 0))).cumsum(-1)
    step = (cdf - u[..., None] * cdf[..., -1:]).abs().amin(-1) / cdf[..., -1]
    margin = torch.minimum(cut, step)
    return torch.where(temperature[:, None] > 0, margin, torch.inf)


@needs_triton
@examples(60)
@given(st.integers(1, 3), st.integers(1, 4), st.sampled_from([2, 7, 100, 1000, 5000]), st.integers(0, 2**16),
       st.lists(st.tuples(st.sampled_from([0.0, 0.3, 1.0, 2.0]), st.sampled_from([0, 1, 3, 10_000]),
                          st.sampled_from([1.0, 0.9, 0.5, 0.0])), min_size=3, max_size=3),
       st.sampled_from(FLOATS))
def test_sample_matches_reference(b, n, V, seed, rows, dtype):
    g = generator(seed)
    logits = (torch.randn(b, n, V, generator=g, device=DEV) * 4).to(dtype)
    temperature, top_k, top_p = (torch.tensor([r[i] for r in rows[:b]], device=DEV) for i in range(3))
    temperature, top_p = temperature.float(), top_p.float()
    u = uniform(torch.arange(b, device=DEV) + seed, torch.arange(n, device=DEV).expand(b, n))
    ref, got = sample_torch(logits, temperature, top_k, top_p, u), sample_triton(logits, temperature, top_k, top_p, u)
    safe = decision_margin(logits, temperature, top_k, top_p, u) > 1e-5  # about 3 positions in 4
    assume(safe.any())
    assert torch.equal(ref[safe], got[safe])


# --- attention ----------------------------------------------------------------------------


@needs_triton
@examples(80)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 16]),
       st.sampled_from([8, 16, 64]), st.integers(0, 70), st.data(), st.booleans(), st.sampled_from(FLOATS))
def test_attention_matches_reference(b, kv_heads, group, B, d, extra, data, causal, dtype):
    L = B + extra
    edge = st.sampled_from([0, 1, L - B])  # no context, one key, the block ending at the cache's end
    starts = data.draw(st.lists(st.one_of(edge, st.integers(0, L - B)), min_size=b, max_size=b))
    g = generator(data.draw(st.integers(0, 2**16)))
    q = torch.randn(b, kv_heads * group, B, d, generator=g, device=DEV).to(dtype)
    # Cache views as the Runtime's: one spare position per row, so the length axis is strided.
    k, v = (torch.randn(b, kv_heads, L + 1, d, generator=g, device=DEV).to(dtype)[:, :, :L] for _ in "kv")
    positions = torch.tensor(starts, device=DEV)[:, None] + torch.arange(B, device=DEV)
    start = positions[:, 0]  # strided, as the models pass it
    close(attention_triton(q, k, v, start, causal), attention_torch(q, k, v, start, causal), dtype)


# --- graph safety, selection, FlashInfer planning -------------------------------------------


@needs_triton
def test_kernels_trace_whole_under_torch_compile():
    """Custom ops with fake implementations: a compiled region holds them without a graph break."""
    g = generator(1)
    q, k, v = (torch.randn(2, 4, 4, 16, generator=g, device=DEV) for _ in "qkv")
    logits, start = torch.randn(2, 4, 50, generator=g, device=DEV), torch.tensor([0, 0], device=DEV)
    block, tokens = torch.zeros(2, 4, dtype=torch.long, device=DEV), torch.zeros(2, dtype=torch.long, device=DEV)
    params = (torch.tensor([1.0, 0.0], device=DEV), torch.zeros(2, dtype=torch.long, device=DEV),
              torch.ones(2, device=DEV), torch.full((2, 4), 0.5, dtype=torch.float64, device=DEV))

    def step(tokens, start):
        h = attention_triton(q, k, v, start, True)
        verified = sample_triton(logits + h.sum(), *params)
        commit_triton(block, verified, None, tokens, start, start.clone(), start > 0, start >= 0,
                      torch.zeros(2, 6, dtype=torch.long, device=DEV))
        return verified

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    t2, s2 = tokens.clone(), start.clone()
    assert torch.equal(compiled(tokens, start), step(t2, s2)) and torch.equal(tokens, t2) and torch.equal(start, s2)


def test_implementation_resolution(monkeypatch):
    cpu = {**dict.fromkeys(selection.OPS, "torch"), "attention": "cpu", "linear": "cpu"}
    assert select("auto", "cpu").implementations == select("cpu", "cpu").implementations == cpu
    assert select("torch", "cpu").implementations == dict.fromkeys(selection.OPS, "torch")
    assert select("auto", "cpu").linear is cpu_ops.linear and select("torch", "cpu").linear is F.linear
    for op, requested, device in [("commit", "flashinfer", "cuda"), ("attention", "flashinfer", "cpu"),
                                  ("attention", "cudnn", "cpu"), ("softmax", "torch", "cpu"),
                                  ("sample", "cpu", "cpu"), ("attention", "cpu", "cuda"), ("linear", "cpu", "cuda"),
                                  ("linear", "triton", "cuda")]:
        with pytest.raises(InputError):
            implementation_for(op, requested, device)
    with pytest.raises(InputError):
        select({"attn": "torch"})
    present = {"triton": True, "flashinfer": True}
    monkeypatch.setattr(selection, "importable", lambda name: present[name])
    assert [implementation_for(op, "auto", "cuda") for op in ("attention", "commit", "linear")] == [
        "flashinfer", "triton", "torch"]
    present["flashinfer"] = False
    assert implementation_for("attention", "auto", "cuda") == "triton"
    with pytest.raises(InputError, match="import flashinfer"):
        implementation_for("attention", "flashinfer", "cuda")
    present["triton"] = False
    assert implementation_for("attention", "auto", "cuda") == "torch"
    with pytest.raises(InputError, match="pip install"):
        implementation_for("commit", "triton", "cuda")


@needs_triton
def test_triton_is_selected_where_it_can_run(monkeypatch):
    assert select({"attention": "triton"}, DEV).implementations["attention"] == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InputError, match="CUDA"):
        implementation_for("commit", "triton", "cpu")


def test_flashinfer_falls_back_where_it_cannot_serve_the_models(reference_pair, monkeypatch):
    """The fixture models are fp32 with head_dim 16: "auto" moves on to Triton (torch without it), a
    named request fails."""
    target, drafter = reference_pair
    picked = {**dict.fromkeys(selection.OPS, "torch"), "attention": "flashinfer"}
    monkeypatch.setattr(selection, "select", lambda spec, device: selection.Kernels(
        picked, *(selection.load(op, b) for op, b in picked.items())))
    chosen = selection.select_for("auto", target, drafter).implementations["attention"]
    assert chosen == ("triton" if TRITON else "torch")
    with pytest.raises(InputError, match="head_dim"):
        selection.select_for({"attention": "flashinfer"}, target, drafter)


def test_import_without_triton():
    """Without triton, `import dflow_rt` works and asking for triton says how to get it; loading models
    and decoding eagerly never import torch's dynamo (which imports triton where installed: about 100
    MB of a small process's resident memory, `bench/peak_rss.py`)."""
    code = ("import sys; sys.modules['triton'] = None; import dflow_rt, dflow_rt.kernels as k; "
            "assert k.select('auto', 'cpu').implementations['commit'] == 'torch'\n"
            "try: k.select('triton', 'cpu')\nexcept dflow_rt.InputError as e: print(e)\n"
            "from dflow_rt.models.bundled import load_models\n"
            "t, d, _ = load_models(None, 'dflash', 'cpu', 1)\n"
            "rt = dflow_rt.Runtime(t, d, dflow_rt.RuntimeConfig(mode='eager', max_batch=1, max_len=64))\n"
            "rt.generate([[1, 2, 3]], max_new_tokens=2)\n"
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "pip install" in run.stdout and "no dynamo" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("causal", [False, True])
def test_flashinfer_plan_describes_the_reference_mask(causal):
    """The paged layout (row = page of `length` keys) and FlashInfer's causal rule (query i sees
    keys up to kv_len - qo_len + i) give exactly the masks the models build."""
    starts, B, length = [0, 5, 12], 4, 16
    qo, kv_indptr, kv_indices, last = plan_inputs(starts, B, length)
    assert qo.tolist() == [0, 4, 8, 12] and kv_indices.tolist() == [0, 1, 2] and kv_indptr.tolist() == [0, 1, 2, 3]
    kv_len = (kv_indptr[1:] - kv_indptr[:-1] - 1) * length + last
    i, key = torch.arange(B)[None, :, None], torch.arange(length)[None, None, :]
    planned = (key < kv_len[:, None, None]).expand(-1, B, -1)
    if causal:
        planned = planned & (key <= (kv_len - B)[:, None, None] + i)
    assert torch.equal(planned, cache_mask(torch.tensor(starts)[:, None] + torch.arange(B), length, causal))
    with pytest.raises(ValueError):
        plan_inputs([13], B, length)
    with pytest.raises(ValueError, match="head_dim"):
        FlashInferAttention().configure(True, 4, 2, 16, torch.float16)


# --- the Runtime with its kernels -----------------------------------------------------------

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"][:3]
PROMPTS = [c["prompt_ids"] for c in CASES]
SAMPLED = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 8, "seed": 4}


@pytest.fixture(scope="module")
def pair():
    """The reference fixture's models, on the kernels' device."""
    return tuple(m.to(DEV) for m in load_pair(FIXTURES))


@needs_triton
def test_runtime_with_triton_kernels_emits_the_torch_tokens(pair):
    """Attention, sampling and commit as kernels: the same tokens, greedy and sampled, with
    requests joining a batch of 2 as rows free up."""
    target, drafter = pair
    runs = {}
    for kernels in ("torch", "triton"):
        rt = Runtime(target, drafter, fixed(max_batch=2, max_len=160, kernels=kernels))
        assert {rt.plan.kernels.implementations[op] for op in selection.SERVES[kernels]} == {kernels}
        runs[kernels] = rt.generate(PROMPTS, max_new_tokens=16), rt.generate(PROMPTS[:2], **SAMPLED)
    assert runs["triton"] == runs["torch"]
    assert runs["torch"][0] == [c["output_ids"][:16] for c in CASES]  # the DFlash reference's tokens


@needs_triton
def test_compiled_round_holds_the_kernels(pair):
    """The whole round, kernels included, under torch.compile(fullgraph=True): no graph break."""
    target, drafter = pair
    config = fixed(max_batch=1, max_len=160, length_buckets=(160,), mode="compile", compiler="aot_eager",
                   kernels="triton")
    expected = Runtime(target, drafter, fixed(max_batch=1, max_len=160, kernels="torch"))
    assert Runtime(target, drafter, config).generate(PROMPTS[:1], max_new_tokens=12) == \
        expected.generate(PROMPTS[:1], max_new_tokens=12)
