"""Exact codes: found only where they rebuild a weight bit for bit, products over them bit-identical
to the float32 kernel's, stale codes never served, and a Runtime over a coded target lossless."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dflow_rt
import dflow_rt.oracle
from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.models import exact_codes
from dflow_rt.models.checkpoint import load_target, save_model
from tests.helpers import build_avx2, hf_greedy, ours_from_hf, tiny_drafter, tiny_hf_target

pytestmark = pytest.mark.skipif(not cpu_ops.enabled(), reason="needs an AVX-512 or AVX2 CPU and a compiler")


def dequantised(w: torch.Tensor, kind: str) -> torch.Tensor:
    """`w` as a GGUF file dequantises it: per block of 32, float16 scales, integer q, d * q (+ m) in float32;
    or ("b16") as a bfloat16 checkpoint loads in float32."""
    if kind == "b16":
        return w.bfloat16().float()
    blocks = w.reshape(w.shape[0], -1, 32)
    if kind == "u4":  # Q4_1
        m = blocks.amin(-1, keepdim=True)
        d = ((blocks.amax(-1, keepdim=True) - m) / 15).half().float()
        q = ((blocks - m) / torch.where(d > 0, d, 1)).round().clamp(0, 15).int().float()
        out = d * q + m.half().float()
    else:  # Q8_0
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
        out = d * (blocks / torch.where(d > 0, d, 1)).round().clamp(-127, 127).int().float()  # no -0.0
    return out.reshape(w.shape).contiguous()


@settings(max_examples=25, deadline=None)
@given(groups=st.integers(1, 12), blocks=st.integers(1, 6), rows=st.integers(1, cpu_ops.MAX_ROWS),
       kind=st.sampled_from(["u4", "i8", "b16"]), seed=st.integers(0, 999))
def test_coded_products_are_bit_identical_to_the_float32_kernel(groups, blocks, rows, kind, seed):
    g = torch.Generator().manual_seed(seed)
    w = dequantised(torch.randn(groups * exact_codes.GROUP, blocks * exact_codes.BLOCK, generator=g), kind)
    codes = exact_codes.encode(w)
    assert codes is not None and codes.kind == kind
    assert torch.equal(exact_codes.decode(codes).view(torch.int32), w.view(torch.int32))
    assert codes.codes.numel() == w.numel() * {"u4": 0.75, "i8": 1.125, "b16": 2}[kind]  # bytes a weight, not 4
    x = torch.randn(rows, w.shape[1], generator=g)
    got = cpu_ops.linear(x, w, codes=codes)
    assert torch.equal(got, torch.ops.dflow_rt.gemv(x, w))
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5 * w.shape[1] ** 0.5)


def test_weights_without_exact_codes_stay_float32():
    g = torch.Generator().manual_seed(0)
    coded = dequantised(torch.randn(8, 64, generator=g), "u4")
    assert exact_codes.encode(torch.randn(8, 64, generator=g)) is None  # float32 noise
    assert exact_codes.encode(coded[:, :48].contiguous()) is None  # a row not whole blocks
    assert exact_codes.encode(coded[:6]) is None  # rows not whole groups
    assert exact_codes.encode(coded.bfloat16()) is None
    half = cpu_ops.Linear(64, 8).bfloat16()
    assert exact_codes.attach(half) is None and half.codes is None  # no float32 CPU weight: nothing tried
    nearly = coded.clone()
    nearly[5, 40] = torch.nextafter(nearly[5, 40], torch.tensor(1.0))  # one value off by an ulp
    assert exact_codes.encode(nearly) is None
    half_valued = dequantised(torch.randn(8, 64, generator=g), "b16")
    half_valued[3, 7] = torch.nextafter(half_valued[3, 7], torch.tensor(1.0))  # one low bit set
    assert exact_codes.encode(half_valued) is None
    source = torch.randn(8, 64, generator=g)
    source[2, 5] = 0.0  # q = 0: the dequantised value is +0.0
    zeros = dequantised(source, "i8")
    assert exact_codes.encode(zeros) is not None and zeros[2, 5].item() == 0.0
    zeros[2, 5] = -0.0  # equal values, other bits: the codes rebuild +0.0, so the weight stays float32
    assert exact_codes.encode(zeros) is None


def test_codes_are_what_is_streamed_and_stale_ones_are_not_served():
    layer = cpu_ops.Linear(64, 8, bias=True)
    with torch.no_grad():
        layer.weight.copy_(dequantised(torch.randn(8, 64), "u4"))
    sizes = exact_codes.attach(layer)
    assert layer.codes is not None and sizes["coded"] == layer.codes.codes.numel() and sizes["plain"] == 0
    x = torch.randn(3, 64)
    with torch.no_grad():
        plain = torch.ops.dflow_rt.gemv(x, layer.weight) + layer.bias
        assert torch.equal(layer(x), plain)
        bytes_ = layer.codes.codes
        bytes_[0, -1] ^= 0x11  # a code changed behind the weight's back: the product must change
        assert not torch.equal(layer(x), plain)
        bytes_[0, -1] ^= 0x11
        layer.weight.add_(1.0)  # the weight changed: its codes are stale and not used
        assert torch.equal(layer(x), torch.ops.dflow_rt.gemv(x, layer.weight) + layer.bias)
        layer.weight.copy_(dequantised(torch.randn(8, 64), "i8"))  # new values that have codes
    exact_codes.attach(layer)  # stale codes dropped, the new values coded
    assert layer.codes is not None and layer.codes.kind == "i8" and layer.codes.version == layer.weight._version
    with torch.no_grad():
        assert torch.equal(layer(x), torch.ops.dflow_rt.gemv(x, layer.weight) + layer.bias)


def coded_pair(tied: bool):
    hf = tiny_hf_target(3, vocab=32, hidden=64, tied=tied, family="llama")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.copy_(dequantised(p, "i8" if "embed" in name or "lm_head" in name else "u4"))
    target = ours_from_hf(hf)
    drafter = tiny_drafter(target, 4, block_size=8)
    if not tied:  # a drafter kept in bfloat16, as the bundled ones are: its own products code as "b16"
        shared = {p.data_ptr() for p in target.parameters()}
        with torch.no_grad():
            for p in drafter.parameters():
                if p.data_ptr() not in shared:
                    p.copy_(p.bfloat16().float())
    return hf, target, drafter


@pytest.mark.parametrize("tied", [True, False])
def test_a_runtime_over_a_coded_target_decodes_exactly_what_plain_decoding_does(monkeypatch, tied):
    hf, target, drafter = coded_pair(tied)
    prompt = [3, 9, 4, 17, 2]
    want = hf_greedy(hf, prompt, 24, suppress=drafter.config.mask_token_id)
    outs = {}
    # a Runtime with codes off drops the codes an earlier one attached; one whose products are torch's
    # ("linear": "torch") also runs none of the C++ ops
    for on, products in (("1", "auto"), ("0", "auto"), ("1", "torch")):
        monkeypatch.setenv("DFLOW_RT_EXACT_CODES", on)
        rt = dflow_rt.Runtime(target, drafter, dflow_rt.RuntimeConfig(
            max_batch=1, max_len=64, mode="eager", verify_width=4, kernels={"linear": products, "attention": "torch"}))
        if (on, products) == ("1", "auto"):  # every product of the target coded; the drafter's only when bf16-valued
            assert set(exact_codes.kinds(target)) == {"u4", "i8"}
            assert set(exact_codes.kinds(drafter)) - {"i8"} == ({"float32"} if tied else {"b16"})
            assert 0 < rt.exact_codes["coded"] < rt.exact_codes["float32"] / 3
        else:
            assert rt.exact_codes is None and set(exact_codes.kinds(target)) == {"float32"}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs[on, products] = rt.generate([prompt], max_new_tokens=24)[0]
        ran = {e.key for e in prof.key_averages() if e.key.startswith("dflow_rt::")}
        assert bool(ran) == (products == "auto"), ran
    assert outs["1", "auto"] == outs["0", "auto"] == outs["1", "torch"] == want


def test_compiled_rounds_stream_the_codes_and_decode_the_same_tokens(monkeypatch):
    """Traced (aot_eager: dynamo's graph without inductor's slow build), the products over codes are
    in the graph and the tokens are plain decoding's; a weight changed afterwards stops the Runtime."""
    monkeypatch.setenv("DFLOW_RT_EXACT_CODES", "1")
    hf, target, drafter = coded_pair(tied=True)
    prompt = [5, 1, 12, 7]
    rt = dflow_rt.Runtime(target, drafter, dflow_rt.RuntimeConfig(
        max_batch=1, max_len=64, mode="compile", compiler="aot_eager", verify_width=4, ar_fallback=False,
        sampling=False))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = rt.generate([prompt], max_new_tokens=16)[0]
    ops = {e.key for e in prof.key_averages()}
    assert {"dflow_rt::gemv_u4", "dflow_rt::gemv_i8"} <= ops
    assert got == hf_greedy(hf, prompt, 16, suppress=drafter.config.mask_token_id)
    weight = target.model.layers[1].mlp.down_proj.weight
    with torch.no_grad(), pytest.raises(RuntimeError, match="single memory location"):
        weight.mul_(2)  # held as its codes: no float32 to write in place
    exact_codes.restore(target)  # float32 again, to change
    with torch.no_grad():  # a weight changed in place: the compiled rounds would read stale codes, so no step runs
        weight.mul_(2)
    with pytest.raises(dflow_rt.InputError, match="after this Runtime was built"):
        rt.generate([prompt], max_new_tokens=4)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="builds AVX2 code on an AVX-512 CPU")
def test_the_avx2_build_rebuilds_and_sums_alike(tmp_path):
    """The other instruction set's code (8 lanes, arithmetic decoding instead of a lookup), built as a
    library of its own: exact values, and coded products bit-identical to its own float32 ones."""
    ops = build_avx2(tmp_path, cpu_ops.SOURCE, "dflow_rt_avx2")
    g = torch.Generator().manual_seed(0)
    for kind in ("u4", "i8", "b16"):
        w = dequantised(torch.randn(20, 96, generator=g), kind)
        codes = exact_codes.encode(w)
        assert torch.equal(getattr(ops, f"decode_{kind}")(codes.codes).view(torch.int32), w.view(torch.int32))
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, 96, generator=g)
            assert torch.equal(getattr(ops, f"gemv_{kind}")(x, codes.codes), ops.gemv(x, w))


def test_projections_of_one_input_run_as_one_stacked_product():
    """q/k/v (and gate/up) codes stacked: one product, bit-identical to three; each part's codes a
    view of the stack; a stale part sends all back to their own products."""
    _, target, _ = coded_pair(tied=True)
    attn = target.model.layers[0].self_attn
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    weights = [p.weight.detach().clone() for p in parts]  # the float32 the codes stand for
    assert exact_codes.attach(target) is not None
    assert attn.merged is not None and target.model.layers[0].mlp.merged is not None
    stacked = attn.merged.codes
    assert all(p.codes.codes.data_ptr() >= stacked.data_ptr() for p in parts)
    assert sum(p.codes.codes.numel() for p in parts) == stacked.numel()
    x = torch.randn(3, attn.q_proj.in_features)
    with torch.no_grad():
        want = [torch.ops.dflow_rt.gemv(x, w) for w in weights]
        got = cpu_ops.linear_parts(x, parts, attn.merged)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        attn.k_proj.weight.data = weights[1] + 1.0  # stale: every part through its own path, k through float32
        got = cpu_ops.linear_parts(x, parts, attn.merged)
        assert torch.equal(got[1], torch.ops.dflow_rt.gemv(x, attn.k_proj.weight)) and torch.equal(got[0], want[0])


def float32_bytes(*models) -> int:
    """Bytes of float32 storage the models' parameters keep (each storage once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for m in models
                for p in m.parameters() if p.dtype == torch.float32}
    return sum(storages.values())


@pytest.mark.parametrize("tied", [True, False])
def test_a_coded_model_holds_its_codes_and_no_float32_copy(monkeypatch, tmp_path, tied):
    """After a Runtime, every coded weight keeps its codes and not its float32 (only the uncoded
    weights, norms and biases, stay float32); the tokens are the oracle's, in eager and compiled rounds;
    the state dict, a saved checkpoint and `restore` give back the very float32 values."""
    monkeypatch.setenv("DFLOW_RT_EXACT_CODES", "1")
    hf, target, drafter = coded_pair(tied)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafted = {k: v.clone() for k, v in drafter.state_dict().items()}
    prompt = [3, 9, 4, 17, 2, 11, 5, 8, 1, 6, 13, 7, 10, 12, 14, 15, 16, 18, 19, 20]  # prefill: over MAX_ROWS
    want = dflow_rt.oracle.generate(target, drafter, prompt, 24).token_ids  # before any codes
    assert want == hf_greedy(hf, prompt, 24, suppress=drafter.config.mask_token_id)
    outs = {}
    for mode in ("eager", "compile"):
        rt = dflow_rt.Runtime(target, drafter, dflow_rt.RuntimeConfig(
            max_batch=1, max_len=64, mode=mode, compiler="aot_eager", verify_width=4, sampling=False))
        outs[mode] = rt.generate([prompt], max_new_tokens=24)[0]
    coded = [m for m in (*target.modules(), *drafter.modules()) if isinstance(m, (cpu_ops.Linear, cpu_ops.Embedding))
             and m.codes is not None]
    assert coded and all(cpu_ops.held(m.weight) for m in coded)
    uncoded = {id(p): p.numel() * 4 for m in (target, drafter) for p in m.parameters() if not cpu_ops.held(p)}
    assert float32_bytes(target, drafter) <= sum(uncoded.values()) + 4 * len(coded)  # one NaN a held weight
    assert float32_bytes(target) < sum(v.numel() * 4 for v in before.values()) / 4
    assert outs["eager"] == outs["compile"] == want
    assert dflow_rt.oracle.generate(target, drafter, prompt, 24).token_ids == want  # the model itself, held
    state = target.state_dict()
    assert state.keys() == before.keys()
    assert all(torch.equal(state[k].view(torch.int32), v.view(torch.int32)) for k, v in before.items())
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in drafted.items())
    saved = load_target(save_model(target, tmp_path / "target"))  # coded again as it loads: held
    assert all(cpu_ops.held(m.weight) for m in saved.modules() if isinstance(m, cpu_ops.Linear))
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in before.items())
    exact_codes.restore(target, drafter)
    assert not any(cpu_ops.held(p) for p in target.parameters())
    assert all(torch.equal(target.state_dict()[k].view(torch.int32), v.view(torch.int32)) for k, v in before.items())
    assert dflow_rt.oracle.generate(target, drafter, prompt, 24).token_ids == want


def test_a_model_in_training_mode_keeps_its_float32():
    """Codes beside the float32 of a model being trained: its optimizer writes the weights in place."""
    _, target, drafter = coded_pair(tied=False)
    drafter.train()
    exact_codes.attach(target, drafter)
    assert all(cpu_ops.held(m.weight) for m in target.modules() if isinstance(m, cpu_ops.Linear))
    assert not any(cpu_ops.held(p) for p in drafter.parameters())
    assert set(exact_codes.kinds(drafter)) >= {"b16"}
    with torch.no_grad():
        drafter.fc.weight.add_(1.0)  # stale codes, not served
    x = torch.randn(2, drafter.fc.in_features)
    with torch.no_grad():
        assert torch.equal(drafter.fc(x), torch.ops.dflow_rt.gemv(x, drafter.fc.weight))


def test_a_runtime_built_in_inference_mode_holds_a_draft_vocabulary_head():
    """`eval-tau` builds its Runtime under `torch.inference_mode()`: the drafter's draft-vocabulary head
    is held as its codes there too (its placeholder once came out an inference tensor, whose version
    cannot be read), and the tokens are the oracle's."""
    hf, target, drafter = coded_pair(tied=True)
    drafter.restrict_vocab(target, torch.arange(0, target.config.vocab_size, 2))
    prompt = [3, 9, 4, 17, 2]
    want = dflow_rt.oracle.generate(target, drafter, prompt, 16).token_ids
    with torch.inference_mode():
        rt = dflow_rt.Runtime(target, drafter, dflow_rt.RuntimeConfig(max_batch=1, max_len=64, mode="eager"))
        got = rt.generate([prompt], max_new_tokens=16)[0]
    assert cpu_ops.held(drafter.vocab_head) and not drafter.vocab_head.is_inference()
    assert got == want
