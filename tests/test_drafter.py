"""The DFlash drafter: the reference fixture, an independent transcription, checkpoint I/O.

(a) `tests/fixtures/dflash_reference` was produced by the public z-lab implementation: our
    target's features and our drafter's forward must reproduce it.
(b) A plain-torch transcription of one draft block, written from the DFlash paper's definition without
    any `dflow_rt.models.layers` helper, against `Drafter.forward` on random tiny models,
    including committed context accumulating in the drafter's cache over two calls.
(c) Checkpoints: the z-lab layout on disk, the nested config schema, and targets we write
    loading in `transformers`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

import dflow_rt
from dflow_rt import Drafter, DrafterConfig, Target, TargetConfig
from tests.conftest import FIXTURES, FIXTURES_LAST_LAYER, REFERENCE_FIXTURES, load_pair
from tests.helpers import whole_block

# Hypothesis' "explain" phase re-runs a failing example under a line tracer, which takes
# minutes on torch code; a failure is still shrunk to a minimal example.
PHASES = [p for p in Phase if p is not Phase.explain]
GARBAGE = 1e3  # scale of the finite junk in unused cache entries: it must never be read


# ----------------------------------------------------------------------------------------- helpers

def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights under `seed`, norm scales included (so a skipped norm shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(noise * 0.5 / p.shape[-1] ** 0.5)
    return module.eval()


def tiny_target(seed=0, layers=4, hidden=32, vocab=40, model_type="qwen3", **kwargs) -> Target:
    config = TargetConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, model_type=model_type,
                          rope_theta=10_000.0, **kwargs)
    return randomize(Target(config), seed)


def tiny_drafter(target: Target, seed=0, layers=2, heads=4, kv_heads=2, head_dim=8, block_size=4,
                 target_layer_ids=(0, 2), rope_theta=12_345.0) -> Drafter:
    t = target.config
    config = DrafterConfig(hidden_size=t.hidden_size, intermediate_size=40, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                           vocab_size=t.vocab_size, block_size=block_size, mask_token_id=t.vocab_size - 1,
                           target_layer_ids=tuple(target_layer_ids), num_target_layers=t.num_hidden_layers,
                           rope_theta=rope_theta)
    return randomize(Drafter(config), seed)


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def target_features(target: Target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    cache = target.new_cache(1, ids.shape[1])
    with torch.no_grad():
        _, features = target(ids, torch.arange(ids.shape[1])[None], cache, torch.zeros(1, dtype=torch.long),
                             layer_ids=tuple(layer_ids))
    return features


def poison(cache, seed: int) -> None:
    """Fill every cache entry with large random junk: only entries written since may be read."""
    gen = torch.Generator().manual_seed(seed)
    for t in cache.tensors():
        t.copy_(GARBAGE * torch.randn(t.shape, generator=gen))


def block_of(token: torch.Tensor, drafter: Drafter) -> torch.Tensor:
    """`[last committed token, MASK x (B-1)]` as a [1, B] id tensor."""
    block = torch.full((1, drafter.block_size), drafter.config.mask_token_id)
    block[0, 0] = token
    return block


# ------------------------------------------------------- (a) the public reference implementation

@pytest.mark.parametrize("fixture", REFERENCE_FIXTURES, ids=lambda p: p.name)
def test_reference_fixture(fixture):
    target, drafter = load_pair(fixture)
    ref = load_file(fixture / "draft_forward.safetensors")
    n = ref["context_ids"].shape[1]
    if fixture == FIXTURES_LAST_LAYER:  # conditioned on the last layer: its feature is post-norm
        assert drafter.target_layer_ids[-1] == target.config.num_hidden_layers - 1

    features = target_features(target, ref["context_ids"], drafter.target_layer_ids)
    assert max_diff(features, ref["context_feature"]) <= 1e-5

    cache = drafter.new_cache(1, 64)
    poison(cache, 0)
    positions = ref["position_ids"]
    with torch.no_grad():
        hidden = drafter(target.embed_tokens(ref["block_ids"]), positions[:, n:], cache=cache,
                         ctx_feat=ref["context_feature"], ctx_pos=positions[:, :n],
                         rows=torch.zeros(1, dtype=torch.long))
        logits = target.lm_head(hidden[:, 1:])
    assert max_diff(hidden, ref["draft_hidden"]) <= 1e-5
    assert max_diff(logits, ref["draft_logits"]) <= 1e-5


# ------------------------------------------------------------ (b) an independent transcription

def ref_rmsnorm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_rope(x, positions, theta):
    """x [seq, heads, head_dim] rotated by its absolute `positions` [seq]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((angles, angles), dim=-1)[:, None]  # [seq, 1, head_dim]
    return x * emb.cos() + rotate_half(x) * emb.sin()


def ref_draft_block(sd, cfg: DrafterConfig, block_emb, block_pos, ctx_feat, ctx_pos):
    """One DFlash draft pass for a single sequence (the DFlash paper's definition), from the state dict alone.

    block_emb [B, H], block_pos [B], ctx_feat [n, K*H] for ALL committed positions ctx_pos [n].
    """
    eps, theta = cfg.rms_norm_eps, cfg.rope_theta
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = ref_rmsnorm(ctx_feat @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    h = block_emb
    for i in range(cfg.num_hidden_layers):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        x = ref_rmsnorm(h, w["input_layernorm.weight"], eps)
        q = (x @ w["self_attn.q_proj.weight"].T).view(-1, heads, d)
        q = ref_rope(ref_rmsnorm(q, w["self_attn.q_norm.weight"], eps), block_pos, theta)
        # Keys/values: the (un-normed) fused context in front of the block, same projections.
        kv_in, kv_pos = torch.cat([ctx, x]), torch.cat([ctx_pos, block_pos])
        k = (kv_in @ w["self_attn.k_proj.weight"].T).view(-1, kv_heads, d)
        k = ref_rope(ref_rmsnorm(k, w["self_attn.k_norm.weight"], eps), kv_pos, theta)
        v = (kv_in @ w["self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # GQA: query head j reads kv head j // group
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)  # no mask: non-causal, all context
        scores = scores - scores.max(-1, keepdim=True).values
        probs = scores.exp() / scores.exp().sum(-1, keepdim=True)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(-1, heads * d)
        h = h + attn @ w["self_attn.o_proj.weight"].T
        x = ref_rmsnorm(h, w["post_attention_layernorm.weight"], eps)
        gate, up = x @ w["mlp.gate_proj.weight"].T, x @ w["mlp.up_proj.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ w["mlp.down_proj.weight"].T
    return ref_rmsnorm(h, sd["norm.weight"], eps)


@st.composite
def drafter_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    target_layers = draw(st.integers(1, 4))
    return dict(
        seed=draw(st.integers(0, 2**16)),
        layers=draw(st.integers(1, 2)),
        kv_heads=kv_heads,
        heads=kv_heads * draw(st.integers(1, 4 // kv_heads)),
        head_dim=draw(st.sampled_from([8, 16])),
        hidden=draw(st.sampled_from([16, 32, 48])),
        block_size=draw(st.sampled_from([2, 4, 8, 16])),
        target_layers=target_layers,
        target_layer_ids=draw(st.lists(st.integers(0, target_layers - 1), min_size=1, max_size=3, unique=True)),
        rope_theta=draw(st.sampled_from([10_000.0, 1_000_000.0])),
    )


def drafter_setup(case):
    target = tiny_target(case["seed"], layers=case["target_layers"], hidden=case["hidden"], vocab=30)
    drafter = tiny_drafter(target, case["seed"] + 1, layers=case["layers"], heads=case["heads"],
                           kv_heads=case["kv_heads"], head_dim=case["head_dim"], block_size=case["block_size"],
                           target_layer_ids=case["target_layer_ids"], rope_theta=case["rope_theta"])
    return target, drafter


def check_draft(target, drafter, ids, features, start, ctx_from, cache, row):
    """Draft the block at `start` after appending context `ctx_from..start-1`; compare with the
    transcription over ALL context `0..start-1`."""
    block_ids = block_of(ids[0, start], drafter)
    block_pos = torch.arange(start, start + drafter.block_size)
    with torch.no_grad():
        emb = target.embed_tokens(block_ids)
        ours = drafter(emb, block_pos[None], cache=cache, ctx_feat=features[:, ctx_from:start],
                       ctx_pos=torch.arange(ctx_from, start)[None], rows=torch.tensor([row]))
        ref = ref_draft_block(drafter.state_dict(), drafter.config, emb[0], block_pos, features[0, :start],
                              torch.arange(start))
    assert ours.shape == (1, drafter.block_size, target.config.hidden_size)
    diff = max_diff(ours[0], ref)
    assert diff <= 1e-5, diff
    return ours


@settings(max_examples=80, deadline=None, derandomize=True, phases=PHASES)
@given(case=drafter_cases(), ctx_len=st.integers(1, 20), row=st.integers(0, 2))
def test_drafter_matches_transcription(case, ctx_len, row):
    target, drafter = drafter_setup(case)
    ids = torch.randint(0, 29, (1, ctx_len + 1), generator=torch.Generator().manual_seed(case["seed"]))
    features = target_features(target, ids, drafter.target_layer_ids)
    cache = drafter.new_cache(3, ctx_len + drafter.block_size + 4)
    poison(cache, case["seed"])
    check_draft(target, drafter, ids, features, ctx_len, 0, cache, row)


@settings(max_examples=50, deadline=None, derandomize=True, phases=PHASES)
@given(case=drafter_cases(), n2=st.integers(2, 20), data=st.data())
def test_drafter_cache_accumulates_committed_context(case, n2, data):
    """Call 1 writes context 0..n1-1 and drafts at n1; call 2 appends n1..n2-1 and drafts at n2.

    Everything beyond the committed context is garbage (and call 1's block slots n1.. are
    stale): the second draft must equal a fresh draft over the whole context 0..n2-1. Block
    keys/values are never kept, so drafting the same block again with no new context (as
    after a round that accepted nothing new) gives the same hidden states.
    """
    target, drafter = drafter_setup(case)
    n1 = data.draw(st.integers(1, n2 - 1), label="n1")
    row = data.draw(st.integers(0, 1), label="row")
    ids = torch.randint(0, 29, (1, n2 + 1), generator=torch.Generator().manual_seed(case["seed"]))
    features = target_features(target, ids, drafter.target_layer_ids)
    cache = drafter.new_cache(2, n2 + drafter.block_size + 4)
    poison(cache, case["seed"])
    check_draft(target, drafter, ids, features, n1, 0, cache, row)
    second = check_draft(target, drafter, ids, features, n2, n1, cache, row)
    with torch.no_grad():
        again = drafter(target.embed_tokens(block_of(ids[0, n2], drafter)),
                        torch.arange(n2, n2 + drafter.block_size)[None], cache=cache, rows=torch.tensor([row]))
    assert torch.equal(again, second)


def test_rotary_tables_match_the_formula_past_a_reserve():
    """Rotary tables are looked up by position; `reserve` grows them for longer caches."""
    from dflow_rt.models.layers import Rotary, apply_rope, rope_cos_sin

    rotary = Rotary(16, 10_000.0, None, 32)
    rotary.reserve(100)
    pos = torch.tensor([0, 5, 31, 32, 99])
    x = torch.randn(5, 2, 16)
    cos, signed_sin = (t[0].transpose(0, 1) for t in rotary(pos[None], torch.float32))
    rotated = apply_rope(x, cos, signed_sin)
    torch.testing.assert_close(rotated, ref_rope(x, pos, 10_000.0))
    # the HF rotation, to the bit, over the same tables
    cos, sin = (t[0].transpose(0, 1) for t in rope_cos_sin(pos[None], rotary.inv_freq, torch.float32))
    assert torch.equal(rotated, x * cos + rotate_half(x) * sin)
    with pytest.raises(IndexError):
        rotary(torch.tensor([[100]]), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_rounds_as_the_hf_models_do(dtype):
    """Normalised in fp32, cast, then scaled in the input dtype: bit for bit the HF formula. Torch's
    path (the weight needs grad here, so the eager C++ op does not serve; tests/test_cpu_eager.py
    holds that op to the formula within rounding)."""
    from dflow_rt.models.layers import RMSNorm

    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    norm.to(dtype)
    x = (torch.randn(3, 5, 64) * 4).to(dtype)
    xf = x.float()
    expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(norm(x), expected)


def test_default_target_layer_ids():
    from dflow_rt.models.drafter import build_target_layer_ids

    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(6, 1) == [3]


# ------------------------------------------------------------------------------ (c) checkpoints

def zlab_keys(layers: int) -> set[str]:
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}_proj.weight" for p in "qkvo"), "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
    return {"fc.weight", "hidden_norm.weight", "norm.weight",
            *(f"layers.{i}.{name}" for i in range(layers) for name in per_layer)}


def draft_once(target, drafter, seed=0, n=9):
    ids = torch.randint(0, target.config.vocab_size - 1, (1, n + 1), generator=torch.Generator().manual_seed(seed))
    features = target_features(target, ids, drafter.target_layer_ids)
    cache = drafter.new_cache(1, n + drafter.block_size)
    with torch.no_grad():
        return drafter(target.embed_tokens(block_of(ids[0, n], drafter)),
                       torch.arange(n, n + drafter.block_size)[None], cache=cache, ctx_feat=features[:, :n],
                       ctx_pos=torch.arange(n)[None], rows=torch.zeros(1, dtype=torch.long))


def test_drafter_checkpoint_has_zlab_layout(tmp_path):
    target = tiny_target(3)
    drafter = tiny_drafter(target, 4, layers=2, block_size=8, target_layer_ids=(0, 3))
    dflow_rt.save_model(drafter, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == zlab_keys(2)
        assert tuple(f.get_slice("fc.weight").get_shape()) == (32, 2 * 32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8
    assert cfg["dflash_config"] == {"mask_token_id": 39, "target_layer_ids": [0, 3]}
    assert cfg["num_target_layers"] == 4 and cfg["rope_theta"] == 12_345.0

    loaded = dflow_rt.load_drafter(tmp_path, target)
    assert loaded.config == drafter.config
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert torch.equal(draft_once(target, loaded), draft_once(target, drafter))


def test_whole_block_flag_round_trips(tmp_path):
    target = tiny_target(3)
    drafter = whole_block(tiny_drafter(target, 4, block_size=8))
    dflow_rt.save_model(drafter, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["draft_whole_block"] is True
    assert dflow_rt.load_drafter(tmp_path, target).config.draft_whole_block


def test_whole_block_drafts_are_a_full_width_pass(reference_pair):
    """At every verify width n < B a `draft_whole_block` drafter drafts what its pass over the whole
    block (slots past n masked) drafts for slots 1..n-1; the cut pass, over n positions, differs."""
    target, drafter = reference_pair
    whole = whole_block(drafter)
    prompt = torch.tensor([json.loads((FIXTURES / "rounds.json").read_text())["cases"][0]["prompt_ids"]])
    P, B, mask = prompt.shape[1], drafter.block_size, drafter.config.mask_token_id
    cut_differs = []
    with torch.inference_mode():
        _, feat = target(prompt, torch.arange(P)[None], target.new_cache(1, P + B), layer_ids=drafter.target_layer_ids)
        def drafts(model, block, n):
            return model.propose(target, block[:, :n], torch.arange(P, P + n)[None],
                                 cache=model.new_cache(1, P + B), ctx_feat=feat, ctx_pos=torch.arange(P)[None])

        for first in range(3):
            block = torch.full((1, B), mask)
            block[0, 0] = first
            full = drafts(drafter, block, B)
            assert torch.equal(drafts(whole, block, B), full)
            for n in range(2, B):
                assert torch.equal(drafts(whole, block, n), full[:, :n - 1]), n
                cut_differs.append(not torch.equal(drafts(drafter, block, n), full[:, :n - 1]))
    assert any(cut_differs)


def test_nested_drafter_config_schema_loads_identically(tmp_path):
    target = tiny_target(5)
    drafter = tiny_drafter(target, 6, block_size=16)
    flat, nested = dflow_rt.save_model(drafter, tmp_path / "flat"), dflow_rt.save_model(drafter, tmp_path / "nested")
    cfg = json.loads((nested / "config.json").read_text())
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    cfg.pop("rope_scaling", None)
    (nested / "config.json").write_text(json.dumps(cfg))

    a, b = dflow_rt.load_drafter(flat, target), dflow_rt.load_drafter(nested, target)
    assert a.config == b.config == drafter.config
    assert torch.equal(a.rotary.inv_freq, b.rotary.inv_freq)
    assert torch.equal(draft_once(target, a), draft_once(target, b))


@pytest.mark.parametrize("model_type, tied, scaling", [
    ("qwen3", False, None),
    ("llama", True, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64}),
])
def test_saved_target_loads_in_transformers(tmp_path, model_type, tied, scaling):
    from transformers import AutoModelForCausalLM

    target = tiny_target(7, model_type=model_type, tie_word_embeddings=tied, rope_scaling=scaling)
    dflow_rt.save_model(target, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]
    ids = torch.randint(0, 40, (1, 80), generator=torch.Generator().manual_seed(7))
    cache = target.new_cache(1, 80)
    with torch.no_grad():
        ours, _ = target(ids, torch.arange(80)[None], cache, torch.zeros(1, dtype=torch.long))
        theirs = hf(ids).logits
    assert max_diff(ours, theirs) <= 1e-4
    reloaded = dflow_rt.load_target(tmp_path)
    assert reloaded.config == target.config
    assert torch.equal(reloaded.rotary.inv_freq, target.rotary.inv_freq)
