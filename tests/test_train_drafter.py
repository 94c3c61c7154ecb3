"""Drafter training: regenerated data, the DFlash objective (mask, labels), DFlow self-conditioning
(relay inputs exactly as the inference round builds them), export, resume.

Tiny budgets: the reference fixture pair for the equivalence tests, and a 4-layer d=64 random target with
a byte-level tokenizer for the command-line runs.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import dflow_rt
import dflow_rt.oracle
from dflow_rt.commands.train import main
from dflow_rt.data import corpus as data
from dflow_rt.data import prompts
from dflow_rt.errors import InputError
from dflow_rt.models import checkpoint
from dflow_rt.models.draft_vocab import save_draft_vocab
from dflow_rt.models.drafter import with_relay
from dflow_rt.models.target import Target, TargetConfig
from dflow_rt.tokenizer import load_tokenizer, train_tokenizer
from dflow_rt.train import anchors, loop, regen, sequences
from dflow_rt.train.drafter_training import freeze_shared_weights, make_optimizer
from dflow_rt.train.loop import clip_gradients
from dflow_rt.train.objective import (
    DraftObjective,
    auto_gamma,
    block_mask,
    draft_hidden,
    drafter_context,
    target_context,
)
from tests.conftest import FIXTURES
from tests.helpers import fixed, random_relay

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]
RUN = ["--block-size", "8", "--layers", "1", "--anchors", "8", "--batch", "2", "--lr", "1e-2", "--warmup", "2",
       "--eval-seqs", "4", "--log-every", "1", "--checkpoint-every", "100", "--eval-prompts", "0", "--threads", "1"]


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def run_cli(argv: list[str]) -> int:
    threads = torch.get_num_threads()
    try:
        return main(argv)
    finally:
        torch.set_num_threads(threads)


def sequence(case: dict, target, drafter, n: int = 64) -> torch.Tensor:
    """A ground-truth row: prompt + the target's greedy continuation (what regen writes)."""
    out = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=n)
    return torch.tensor([case["prompt_ids"] + out.token_ids])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random 4-layer Qwen3 (sharp enough logits for varied greedy text) with a byte-level tokenizer."""
    tokenizer = train_tokenizer([], vocab_size=260)
    torch.manual_seed(0)
    target = Target(TargetConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0,
                                 tie_word_embeddings=True))
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    out = dflow_rt.save_model(target, tmp_path_factory.mktemp("tiny") / "target")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data_file(tiny_dir) -> Path:
    out = tiny_dir.parent / "data.safetensors"
    assert run_cli(["regen", "--target", str(tiny_dir), "--out", str(out), "--prompts", "24", "--max-new-tokens",
                    "56", "--max-prompt-tokens", "40", "--batch", "8", "--threads", "1"]) == 0
    return out


@pytest.fixture(scope="module")
def dflash_run(tiny_dir, data_file) -> Path:
    out = tiny_dir.parent / "dflash"
    assert run_cli(["dflash", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(out), *RUN,
                    "--steps", "24", "--eval-prompts", "2", "--checkpoint-every", "12"]) == 0
    return out


# --------------------------------------------------------------------------- objective vs inference

def test_training_forward_equals_inference_forward_and_labels_are_unshifted(reference_pair):
    """Each anchor block of the batched training forward sees exactly the context < p that `Drafter.forward`
    sees at inference (context <= p was a real bug), and slot k is scored against x_{p+k} (shifted labels
    were the other): both drove tau to about 1."""
    target, drafter = reference_pair
    ids = sequence(CASES[0], target, drafter)
    L, B, layer_ids = ids.shape[1], drafter.block_size, drafter.target_layer_ids
    starts = torch.tensor([[1, 5, 29, 30, L - B]])
    with torch.no_grad():
        feats, _ = target_context(target, ids, layer_ids)
        assert torch.equal(feats, target(ids, torch.arange(L)[None], layer_ids=layer_ids)[1])
        block = torch.full((1, 5, B), drafter.config.mask_token_id)
        block[..., 0] = ids[0, starts[0]]
        emb = target.embed_tokens(block.flatten(1))
        train_logits = target.lm_head(draft_hidden(drafter, drafter_context(drafter, feats), emb, starts))
        loss, stats = DraftObjective(drafter, target, gamma=7.0)(ids, torch.tensor([L]), starts,
                                                                  torch.ones(1, 5, dtype=torch.bool))
    w = torch.exp(-torch.arange(B - 1) / 7.0)
    manual = []
    for n, p in enumerate(starts[0].tolist()):
        cache = drafter.new_cache(1, L + B)
        with torch.no_grad():
            h = drafter(emb[:, n * B:(n + 1) * B], torch.arange(p, p + B)[None], cache=cache, ctx_feat=feats[:, :p],
                        ctx_pos=torch.arange(p)[None], rows=torch.zeros(1, dtype=torch.long))
        ref = target.lm_head(h)
        torch.testing.assert_close(train_logits[:, n * B:(n + 1) * B], ref, atol=1e-5, rtol=1e-5)
        ce = F.cross_entropy(ref[0, 1:], ids[0, p + 1:p + B], reduction="none")
        manual.append((ce * w).sum() / w.sum())
    torch.testing.assert_close(loss, torch.stack(manual).mean(), atol=1e-5, rtol=1e-5)
    mask = block_mask(L, starts, B, causal=False)[0]
    assert mask[B, :L].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]  # anchor 5: positions 0..4 only
    assert mask[B:2 * B, L:].sum() == B * B and mask[B:2 * B, L + 2 * B:].sum() == 0  # itself, fully; no other
    assert stats["slots1"].sum() == 5 * (B - 1) and auto_gamma(16) == 7 and auto_gamma(8) == 4


def test_rounds_unrolled_from_the_prompt_are_the_rounds_of_generate(reference_pair):
    """Evaluation's tau: unrolled on prompt + greedy continuation, training rounds accept exactly what
    `generate` accepts (all but the last round, which `generate` cuts at max_new_tokens)."""
    target, drafter = reference_pair
    for case in CASES:
        out = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=64)
        ids = torch.tensor([case["prompt_ids"] + out.token_ids])
        trace = []
        with torch.no_grad():
            DraftObjective(drafter, target, 7.0)(ids, torch.tensor([ids.shape[1]]), torch.tensor([[len(
                case["prompt_ids"])]]), torch.ones(1, 1, dtype=torch.bool), trace, rounds=1000)
        rounds = [int(step["accepted"]) + 1 for step in trace]
        assert rounds[:-1] == out.acceptance_lengths[:len(rounds) - 1] and len(rounds) == len(out.acceptance_lengths)


def test_a_draft_vocabulary_scores_its_own_head_rows_and_skips_labels_outside_it(reference_pair):
    """With a draft vocabulary the objective is cross-entropy over the full head's columns of those tokens
    (what the inference draft pass ranks); a label outside it weighs nothing; drafts are token ids."""
    target, full = reference_pair
    drafter = copy.deepcopy(full)
    ids = sequence(CASES[0], target, drafter)
    L, B = ids.shape[1], drafter.block_size
    starts, ok = torch.tensor([[1, 9, L - B]]), torch.ones(1, 3, dtype=torch.bool)
    labels = torch.stack([ids[0, p + 1:p + B] for p in starts[0].tolist()])
    vocab = torch.cat([labels.unique()[::2], torch.tensor([drafter.config.mask_token_id])]).unique()
    drafter.restrict_vocab(target, vocab)
    trace = []
    with torch.no_grad():
        loss, stats = DraftObjective(drafter, target, gamma=7.0)(ids, torch.tensor([L]), starts, ok, trace)
        feats, _ = target_context(target, ids, drafter.target_layer_ids)
        block = torch.full((1, 3, B), drafter.config.mask_token_id)
        block[..., 0] = ids[0, starts[0]]
        hidden = draft_hidden(drafter, drafter_context(drafter, feats), target.embed_tokens(block.flatten(1)), starts)
    columns = target.lm_head(hidden).view(3, B, -1)[:, 1:, vocab]  # the full head, then the vocabulary's columns
    w = torch.exp(-torch.arange(B - 1) / 7.0)
    inside = (labels[..., None] == vocab).any(-1)
    target_cols = (labels[..., None] == vocab).int().argmax(-1)
    ce = F.cross_entropy(columns.flatten(0, 1), target_cols.flatten(), reduction="none").view(3, B - 1)
    weights = w * inside
    torch.testing.assert_close(loss, (ce * weights).sum() / weights.sum(), atol=1e-5, rtol=1e-5)
    assert 0 < inside.float().mean() < 1  # the case exercises both kinds of label
    assert torch.equal(trace[0]["drafts"][0], vocab[columns.argmax(-1)])
    assert stats["slots1"].sum() == 3 * (B - 1)  # accuracy still counts every slot


@pytest.mark.parametrize("relay_input", ["mask_embedding", "kv"])
def test_dflow_relay_inputs_match_the_inference_round(reference_pair, relay_input):
    """Unrolled from the prompt's first round, training drafts, accepts and relays exactly what
    `dflow_rt.generate` does: same drafts, a, c (bonus), d (first rejected draft), slot mapping, relay
    (and, for a `kv` relay, the batched relay attention gives the drafts of the one-block inference pass)."""
    target, drafter = reference_pair[0], random_relay(reference_pair[1], relay_input=relay_input)
    checked = 0
    for case in CASES:
        seen = {"drafts": [], "relay": []}
        propose, relay_vectors = drafter.propose, drafter.relay_vectors

        def spy_propose(*args, seen=seen, propose=propose, **kwargs):
            seen["drafts"].append(propose(*args, **kwargs))
            return seen["drafts"][-1]

        def spy_relay(target, buf, *args, seen=seen, relay_vectors=relay_vectors):
            seen["relay"].append((buf.accepted.clone(), buf.bonus.clone(), buf.rejected.clone(),
                                  relay_vectors(target, buf, *args)))
            return seen["relay"][-1][3]

        drafter.propose, drafter.relay_vectors = spy_propose, spy_relay
        ids = sequence(case, target, drafter)
        del drafter.propose, drafter.relay_vectors
        trace = []
        with torch.no_grad():
            DraftObjective(drafter, target, 7.0, rounds=3)(ids, torch.tensor([ids.shape[1]]),
                                                           torch.tensor([[len(case["prompt_ids"])]]),
                                                           torch.ones(1, 1, dtype=torch.bool), trace)
        assert len(trace) == 3
        for r, step in enumerate(trace):
            assert torch.equal(step["drafts"][0], seen["drafts"][r]), f"round {r + 1} drafts"
            if r == 2:
                break
            accepted, bonus, rejected, emb = seen["relay"][r + 1]
            buf = step["relay"]
            assert (buf.accepted, buf.bonus, buf.rejected) == (accepted, bonus, rejected), f"round {r + 2} a/c/d"
            ours, valid = drafter.relay_vectors(target, buf, None)
            torch.testing.assert_close(ours, emb[0], atol=1e-4, rtol=1e-4)
            assert torch.equal(valid, emb[1])
            checked += int(accepted) < drafter.block_size - 1  # a round with a rejected suffix to relay
    assert checked >= 8


@pytest.mark.parametrize("relay_input", ["mask_embedding", "kv"])
def test_base_first_round_routes_later_rounds_to_the_relay_alone(reference_pair, relay_input):
    """With `base_first_round`, the shared weights get exactly the DFlash loss's gradient (round 1) and the
    relay gets the later rounds' gradient, the same as the default objective gives the relay."""
    target, drafter = reference_pair[0], random_relay(reference_pair[1], relay_input=relay_input)
    ids = sequence(CASES[0], target, drafter)
    batch = (ids, torch.tensor([ids.shape[1]]), torch.tensor([[2, 9, 20]]), torch.ones(1, 3, dtype=torch.bool))

    def grads(**kwargs) -> dict[str, torch.Tensor]:
        drafter.zero_grad(set_to_none=True)
        DraftObjective(drafter, target, 7.0, **kwargs)(*batch)[0].backward()
        return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in drafter.named_parameters()}

    split, dflash, joint = grads(rounds=3, base_first_round=True), grads(rounds=1), grads(rounds=3)
    relay = [n for n in split if n.startswith("relay.")]
    assert relay and all(split[n].abs().sum() > 0 for n in relay)
    for n in split:
        torch.testing.assert_close(split[n], joint[n] if n in relay else dflash[n], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(joint["fc.weight"], dflash["fc.weight"])  # the default routes later rounds to all


def test_frozen_shared_weights_leave_the_relay_gradient_unchanged(reference_pair):
    """--freeze-base: the shared weights get no gradient at all, the relay exactly the one it gets when every
    weight trains (the speed-up drops only gradients that --base-lr-scale 0 discards)."""
    target, drafter = reference_pair[0], random_relay(reference_pair[1])
    ids = sequence(CASES[0], target, drafter)
    batch = (ids, torch.tensor([ids.shape[1]]), torch.tensor([[2, 9, 20]]), torch.ones(1, 3, dtype=torch.bool))
    DraftObjective(drafter, target, 7.0, rounds=3)(*batch)[0].backward()
    joint = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad(set_to_none=True)
    freeze_shared_weights(drafter)
    DraftObjective(drafter, target, 7.0, rounds=3)(*batch)[0].backward()
    relay = [n for n in joint if n.startswith("relay.")]
    assert relay and all(joint[n].abs().sum() > 0 for n in joint)
    for n, p in drafter.named_parameters():
        assert (p.grad is None) == (n not in relay), n
        if n in relay:
            torch.testing.assert_close(p.grad, joint[n], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------- data

def test_regen_writes_target_greedy_continuations_of_training_prompts(tiny_dir, data_file, tmp_path):
    seqs = sequences.load_sequences(data_file)
    tokenizer = load_tokenizer(tiny_dir)
    target = dflow_rt.load_target(tiny_dir)
    assert len(seqs) == 24 and set(seqs.kinds.tolist()) == {0, 1, 2}
    texts = [tokenizer.decode(seqs[i][:int(seqs.prompt_lens[i])]) for i in range(len(seqs))]
    for i in range(len(seqs)):
        kind, prompt = prompts.training_prompt(tokenizer, 0, i, 40)
        assert seqs[i][:len(prompt)].tolist() == prompt and kind == seqs.kinds[i]
    for i in (0, 1, 2):  # batched greedy == the reference round without a drafter
        P = int(seqs.prompt_lens[i])
        cont = dflow_rt.oracle.generate(target, None, seqs[i][:P], max_new_tokens=len(seqs[i]) - P).token_ids
        assert seqs[i][P:].tolist() == cont
    heldout = data.heldout_chat_prompts() + data.heldout_math_prompts(200)
    assert not any(q in t for q in heldout for t in texts)
    # A rerun continues from the partial file and writes the same sequences.
    done = tmp_path / "again.safetensors"
    sequences.save_sequences(done.with_name(done.name + ".partial"), [seqs[i].tolist() for i in range(8)],
                         seqs.prompt_lens[:8].tolist(), seqs.kinds[:8].tolist(), {**seqs.meta, "target": "x"})
    regen.regenerate(tiny_dir, done, regen.RegenSettings(prompts=24, max_new_tokens=56, batch=8, max_prompt_tokens=40))
    assert torch.equal(sequences.load_sequences(done).tokens, seqs.tokens)
    # A later range of prompts (fresh data for a continuation) is the tail of the full run.
    tail = tmp_path / "tail.safetensors"
    assert run_cli(["regen", "--target", str(tiny_dir), "--out", str(tail), "--prompts", "8", "--first-prompt", "16",
                    "--max-new-tokens", "56", "--max-prompt-tokens", "40", "--batch", "8", "--threads", "1"]) == 0
    later = sequences.load_sequences(tail)
    assert [later[i].tolist() for i in range(8)] == [seqs[i].tolist() for i in range(16, 24)]
    assert later.meta["first_prompt"] == 16 and "first_prompt" not in seqs.meta
    # Ranges regenerated apart and joined in order are the single run; out of order or with a gap, refused.
    head = tmp_path / "head.safetensors"
    regen.regenerate(tiny_dir, head, regen.RegenSettings(prompts=16, max_new_tokens=56, batch=8, max_prompt_tokens=40))
    assert run_cli(["join", str(head), str(tail), "--out", str(tmp_path / "joined.safetensors")]) == 0
    joined = sequences.load_sequences(tmp_path / "joined.safetensors")
    for key in ("tokens", "offsets", "prompt_lens", "kinds"):
        assert torch.equal(getattr(joined, key), getattr(seqs, key)), key
    def setting(meta):
        return {k: v for k, v in meta.items() if k != "target"}
    assert setting(joined.meta) == setting(seqs.meta)
    with pytest.raises(InputError, match="starts at prompt 0, expected 24"):
        regen.join_regen([tail, head], tmp_path / "bad.safetensors")
    with pytest.raises(InputError, match="expected 16"):
        regen.join_regen([head, head], tmp_path / "bad.safetensors")
    with pytest.raises(InputError, match="first-prompt"):
        regen.regenerate(tiny_dir, tmp_path / "bad.safetensors", regen.RegenSettings(prompts=2, first_prompt=-1))


def test_anchor_batches_do_not_depend_on_world_size(data_file):
    seqs = sequences.load_sequences(data_file)
    one = anchors.AnchorBatches(seqs, list(range(20)), 4, 6, 8, 1, seed=3)
    ranks = [anchors.AnchorBatches(seqs, list(range(20)), 4, 6, 8, 1, seed=3, rank=r, world=2) for r in (0, 1)]
    for _ in range(7):  # across an epoch boundary
        batch = one.next()
        parts = [r.next() for r in ranks]
        assert batch.keys() == {"ids", "lengths", "starts", "ok"}
        for key in ("starts", "lengths"):
            assert torch.equal(batch[key], torch.cat([p[key] for p in parts]))
    assert one.state() == {"epoch": 1, "index": 2}
    rows = list(range(len(seqs)))
    ids, lengths, starts, ok = anchors.collate(seqs, rows, 6, 24, 8, [str(i) for i in rows])
    assert ok.any(1).all() and torch.equal(lengths, seqs.lengths())
    for i in rows:  # distinct anchors in the continuation, with room for the span (else for one block)
        mine = starts[i][ok[i]]
        assert mine.unique().numel() == len(mine) and (mine >= seqs.prompt_lens[i]).all()
        assert (mine + (24 if lengths[i] - 24 >= seqs.prompt_lens[i] else 8) <= lengths[i]).all()
        assert torch.equal(ids[i, :lengths[i]], seqs[i])


# ------------------------------------------------------------------------------------- training

def test_dflash_training_lowers_loss_and_exports_a_lossless_drafter(dflash_run, tiny_dir):
    records = log(dflash_run)
    curve = [r["last_loss"] for r in records if r["event"] == "train"]
    assert len(curve) == 24 and sum(curve[-4:]) / 4 < curve[0] - 2
    draft = [r for r in records if r["event"] == "draft"]
    assert len(draft[-1]["slot_acc"]) == 7 and {"loss1", "tau1", "eta_s", "s_per_step"} <= draft[-1].keys()
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [12, 24] and all(r["tau"] >= 1 for r in evals)
    cfg = json.loads((dflash_run / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8 and "dflow_config" not in cfg
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [2]}  # <|MASK|>; layers(4, 1)
    keys = set(load_file(dflash_run / "model.safetensors"))
    assert "fc.weight" in keys and not any("embed" in k or "lm_head" in k for k in keys)
    target = dflow_rt.load_target(tiny_dir)
    drafter = dflow_rt.load_drafter(dflash_run, target)
    seqs = sequences.load_sequences(tiny_dir.parent / "data.safetensors")
    for i in (20, 21, 22, 23):  # held-out rows
        prompt = seqs[i][:int(seqs.prompt_lens[i])]
        spec = dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=40)
        assert spec.token_ids == dflow_rt.oracle.generate(target, None, prompt, max_new_tokens=40).token_ids


@pytest.mark.parametrize("kind, flags", [("dflash", []), ("dflow", []), ("dflow", ["--freeze-base"])])
def test_resume_gives_the_same_weights_as_an_uninterrupted_run(kind, flags, tiny_dir, data_file, dflash_run, tmp_path):
    extra = (["--init", str(dflash_run)] if kind == "dflow" else []) + flags
    runs = {}
    for name, budgets in (("straight", [[]]), ("resumed", [["--run-steps", "2"], ["--resume"]])):
        out = tmp_path / name
        for b in budgets:
            args = ["--threads", "1", "--eval-prompts", "0"] if b == ["--resume"] else [*RUN, *extra, "--steps", "4"]
            assert run_cli([kind, "--target", str(tiny_dir), "--data", str(data_file), "--out", str(out), *args,
                            *b]) == 0
        runs[name] = load_file(out / "model.safetensors")
    assert log(tmp_path / "resumed")[-1]["event"] == "end"
    assert all(torch.equal(runs["straight"][k], runs["resumed"][k]) for k in runs["straight"])


def test_dflow_training_writes_a_loadable_dflow_drafter(tiny_dir, data_file, dflash_run, tmp_path, capsys):
    out = tmp_path / "dflow"
    assert run_cli(["dflow", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(out), *RUN,
                    "--init", str(dflash_run), "--relay-hidden", "24", "--steps", "2", "--eval-prompts", "2"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflow_config"]["relay_hidden"] == 24 and cfg["block_size"] == 8
    weights, parent = load_file(out / "model.safetensors"), load_file(dflash_run / "model.safetensors")
    assert torch.count_nonzero(weights["relay.fc2.weight"]) > 0  # trained away from the zero init
    assert not torch.equal(weights["fc.weight"], parent["fc.weight"])
    draft = [r for r in log(out) if r["event"] == "draft"]
    assert {"loss1", "loss2", "loss3", "tau1", "tau2", "tau3"} <= draft[-1].keys()
    assert {"tau", "tau_norelay"} <= next(r for r in log(out) if r["event"] == "eval").keys()
    target = dflow_rt.load_target(tiny_dir)
    drafter = dflow_rt.load_drafter(out, target)
    assert drafter.relay is not None and drafter.use_relay
    prompt = sequences.load_sequences(data_file)[22][:40]
    assert (dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=40).token_ids ==
            dflow_rt.oracle.generate(target, None, prompt, max_new_tokens=40).token_ids)
    # From scratch: a fresh DFlow drafter (zero-init relay) of the requested shape.
    scratch = tmp_path / "scratch"
    assert run_cli(["dflow", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(scratch), *RUN,
                    "--steps", "1", "--base-first-round"]) == 0
    assert json.loads((scratch / "config.json").read_text())["dflow_config"]["relay_hidden"] == 64
    assert log(scratch)[0]["settings"]["base_first_round"] is True
    # `train dflash --init` continues a DFlash drafter (here at a negligible lr) and refuses a DFlow one.
    data = ["--target", str(tiny_dir), "--data", str(data_file), *RUN, "--steps", "1"]
    assert run_cli(["dflash", *data, "--out", str(tmp_path / "bad"), "--init", str(out)]) == 2
    with_vocab = tmp_path / "with_vocab"  # a draft vocabulary belongs to the data, not to the weights
    shutil.copytree(dflash_run, with_vocab)
    save_draft_vocab(with_vocab, torch.arange(8))
    assert run_cli(["dflash", *data, "--out", str(tmp_path / "cont"), "--init", str(with_vocab), "--lr", "1e-12"]) == 0
    assert not (tmp_path / "cont" / "draft_vocab.json").exists()
    cont = load_file(tmp_path / "cont" / "model.safetensors")
    assert all(torch.allclose(cont[k], parent[k], atol=1e-6) for k in parent)
    # --init fixes the shape: a setting that contradicts the parent is an error, not silently ignored.
    common = ["--target", str(tiny_dir), "--data", str(data_file), *RUN, "--steps", "1", "--init"]
    assert run_cli(["dflow", *common, str(out), "--out", str(tmp_path / "c1"), "--relay-input", "kv"]) == 2
    assert run_cli(["dflow", *common, str(out), "--out", str(tmp_path / "c2"), "--relay-hidden", "32"]) == 2
    assert run_cli(["dflash", *common, str(dflash_run), "--out", str(tmp_path / "c3"), "--layers", "3"]) == 2
    assert capsys.readouterr().err.count("fixes the drafter's shape; conflicting: --") == 3
    # --block-size re-blocks the parent: the same weights, as a drafter of another block size
    assert run_cli(["dflash", *common, str(dflash_run), "--out", str(tmp_path / "b4"), "--block-size", "4",
                    "--lr", "1e-12"]) == 0
    assert json.loads((tmp_path / "b4" / "config.json").read_text())["block_size"] == 4
    reblocked = load_file(tmp_path / "b4" / "model.safetensors")
    assert all(torch.allclose(reblocked[k], parent[k], atol=1e-6) for k in parent)
    assert run_cli(["dflow", *common, str(out), "--out", str(tmp_path / "c4"), "--relay-hidden", "24",
                    "--block-size", "8", "--lr", "1e-12"]) == 0  # repeating the parent's own shape is fine
    # --freeze-base: the relay alone trains; the shared weights stay bit for bit the parent's.
    assert run_cli(["dflow", *common, str(out), "--out", str(tmp_path / "f"), "--freeze-base"]) == 0
    frozen = load_file(tmp_path / "f" / "model.safetensors")
    assert all(torch.equal(frozen[k], weights[k]) != k.startswith("relay.") for k in weights)
    assert log(tmp_path / "f")[0]["settings"]["base_lr_scale"] == 0.0
    for bad in (["--base-first-round"], ["--base-lr-scale", "0.5"]):
        assert run_cli(["dflow", *common, str(out), "--out", str(tmp_path / "f2"), "--freeze-base", *bad]) == 2
    assert capsys.readouterr().err.count("--freeze-base trains the relay alone") == 2


def test_training_runs_in_float32_where_targets_load_in_bf16(tiny_dir, data_file, dflash_run, tmp_path, monkeypatch):
    """On CUDA `load_target` defaults to bf16; drafter training must still feed float32 features to its
    float32 weights (on a GPU it stopped at its first step with a dtype mismatch when it did not)."""
    monkeypatch.setattr(checkpoint, "default_dtype", lambda device: torch.bfloat16)
    out = tmp_path / "dflow"
    assert run_cli(["dflow", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(out), *RUN,
                    "--init", str(dflash_run), "--steps", "2"]) == 0
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.float32}


def test_relay_learning_rate_scale(reference_pair):
    """The shared loop sets one lr on every group; the relay's scale must still apply (0 freezes it)."""
    target, parent = reference_pair
    drafter = with_relay(parent, relay_hidden=8)
    opt = make_optimizer(drafter, lr=1e-2, weight_decay=0.0, relay_lr_scale=0.0)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    for p in drafter.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    after = drafter.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("relay."))
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
    assert all(g["lr"] == 1e-2 for g in opt.param_groups)
    opt = make_optimizer(drafter, lr=1e-2, weight_decay=0.1, base_lr_scale=0.0)  # the relay alone
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    opt.step()
    after = drafter.state_dict()
    assert all(torch.equal(before[k], after[k]) != k.startswith("relay.") for k in before)


def test_relay_gradients_clipped_apart(reference_pair):
    """With `clip_relay_apart` (--base-first-round) the relay's gradients cannot shrink the base's step:
    each part is clipped to the norm on its own; without it, one joint clip as before."""
    drafter = with_relay(reference_pair[1], relay_hidden=8)

    def clipped(apart: bool) -> tuple[float, float, float]:
        opt = make_optimizer(drafter, lr=1e-2, weight_decay=0.0, clip_relay_apart=apart)
        for name, p in drafter.named_parameters():
            p.grad = torch.full_like(p, 10.0 if name.startswith("relay.") else 1e-3)
        total = clip_gradients(drafter, opt, 1.0)
        norms = [torch.linalg.vector_norm(torch.stack([p.grad.norm() for n, p in drafter.named_parameters()
                                                       if n.startswith("relay.") == relay])) for relay in (False, True)]
        return total, float(norms[0]), float(norms[1])

    base_grad = 1e-3 * sum(p.numel() for n, p in drafter.named_parameters() if not n.startswith("relay.")) ** 0.5
    total, base, relay = clipped(apart=True)
    assert base == pytest.approx(base_grad, rel=1e-5) and relay == pytest.approx(1.0, rel=1e-5)
    assert total > 10  # the norm before clipping
    _, base, relay = clipped(apart=False)
    assert (base ** 2 + relay ** 2) ** 0.5 == pytest.approx(1.0, rel=1e-5) and base < 0.01 * base_grad


def test_bad_invocations_are_refused(tiny_dir, data_file, dflash_run, capsys):
    base = ["--target", str(tiny_dir), "--data", str(data_file), "--out", str(dflash_run)]
    assert run_cli(["dflash", *base, *RUN, "--steps", "3"]) == 2  # never overwrites a checkpoint
    assert run_cli(["dflash", *base, "--resume", "--lr", "0.5", "--threads", "1"]) == 2
    assert run_cli(["dflow", *base, "--resume", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "pass --resume" in err and "conflicting: --lr 0.5" in err and "holds a dflash run" in err
    assert os.path.exists(dflash_run / "config.json")


def test_ddp_two_ranks_match_one_process_for_dflow(tiny_dir, data_file, dflash_run, tmp_path):
    """2 gloo ranks x 2 sequences against 1 process x 4: the same global batches, anchors and schedule, so
    the same loss curve up to summation order (see the target's DDP test for the tolerance's reasoning)."""
    import subprocess
    import sys

    common = ["dflow", "--target", str(tiny_dir), "--data", str(data_file), *RUN, "--init", str(dflash_run),
              "--steps", "6"]
    one = tmp_path / "one"
    assert run_cli([*common, "--out", str(one), "--batch", "4"]) == 0
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "dflow_rt.commands.train", *common, "--out", str(two), "--batch", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curves = [{r["step"]: r["last_loss"] for r in log(out) if r["event"] == "train"} for out in (one, two)]
    assert sorted(curves[0]) == sorted(curves[1]) == list(range(1, 7))
    assert max(abs(curves[0][s] - curves[1][s]) for s in curves[0]) < 1e-4
    assert curves[0][1] != curves[0][6]  # it trained
    assert log(two)[0]["world"] == 2


def test_bf16_target_trains_a_float32_drafter_like_a_float32_target(reference_pair):
    """`--target-dtype bfloat16`: the frozen target in bf16 under a float32 DFlow drafter (casts where they
    meet: embeddings, features, head, relay inputs) gives the float32 target's loss and gradients up to
    bf16 rounding."""
    target, drafter = reference_pair[0], random_relay(reference_pair[1])
    ids = sequence(CASES[0], target, drafter)
    batch = (ids, torch.tensor([ids.shape[1]]), torch.tensor([[2, 9, 20]]), torch.ones(1, 3, dtype=torch.bool))

    def run(t) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        drafter.zero_grad(set_to_none=True)
        loss = DraftObjective(drafter, t, 7.0, rounds=3)(*batch)[0]
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}

    loss32, grads32 = run(target)
    loss16, grads16 = run(copy.deepcopy(target).to(torch.bfloat16))
    assert loss16.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads16.values())
    torch.testing.assert_close(loss16, loss32, rtol=2e-2, atol=0)
    for name in ("fc.weight", "layers.0.mlp.down_proj.weight", "relay.fc2.weight"):
        assert F.cosine_similarity(grads16[name].flatten(), grads32[name].flatten(), dim=0) > 0.98, name


def test_generate_is_lossless_with_a_bf16_target_and_a_float32_drafter(reference_pair):
    """Mixed dtypes at inference too: the drafts cross over, the bf16 target's own greedy text comes out."""
    target = copy.deepcopy(reference_pair[0]).to(torch.bfloat16)
    drafter = random_relay(reference_pair[1])
    for case in CASES[:2]:
        plain = dflow_rt.oracle.generate(target, None, case["prompt_ids"], max_new_tokens=40).token_ids
        out = dflow_rt.oracle.generate(target, drafter, case["prompt_ids"], max_new_tokens=40)
        assert out.token_ids == plain and out.tau > 1  # drafts crossed over and were accepted
        runtime = dflow_rt.Runtime(target, drafter, fixed(max_batch=2, max_len=256))
        assert runtime.generate([case["prompt_ids"]], max_new_tokens=40)[0] == plain


def test_target_dtype_option_trains_and_is_kept_on_resume(tiny_dir, data_file, dflash_run, tmp_path, capsys):
    out = tmp_path / "dflow-bf16"
    args = ["dflow", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(out), *RUN,
            "--init", str(dflash_run), "--steps", "3", "--eval-prompts", "1", "--target-dtype", "bfloat16"]
    assert run_cli([*args, "--run-steps", "2"]) == 0
    ckpt = load_file(out / "checkpoint" / "model" / "model.safetensors")
    assert {v.dtype for v in ckpt.values()} == {torch.float32}  # the drafter trains in float32
    assert run_cli([*args[:-2], "--resume", "--target-dtype", "float32"]) == 2
    assert "conflicting: --target-dtype float32" in capsys.readouterr().err
    assert run_cli([*args[:-2], "--resume"]) == 0
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.float32}
    records = log(out)
    assert records[0]["settings"]["target_dtype"] == "bfloat16"
    assert all(torch.isfinite(torch.tensor(r["loss1"])) for r in records if r["event"] == "draft")


@pytest.mark.parametrize("native", [False, True])
def test_bf16_settings_warn_on_a_cpu_that_emulates_bf16(native, monkeypatch, capsys):
    monkeypatch.setattr(loop, "cpu_has_bf16", lambda: native)
    main_rank, cpu = loop.Dist(), torch.device("cpu")
    loop.warn_emulated_bf16({"amp": "bfloat16", "target_dtype": "bfloat16"}, cpu, main_rank)
    loop.warn_emulated_bf16({"amp": "float32", "target_dtype": "float32"}, cpu, main_rank)
    err = capsys.readouterr().err
    assert err.count("warning:") == (0 if native else 1)
    assert native or "--amp bfloat16 and --target-dtype bfloat16 on a CPU without BF16 instructions" in err


def test_draft_vocab_sequences_and_amp_options(tiny_dir, data_file, tmp_path, capsys):
    """--sequences N trains on the first N rows (the draft vocabulary counts only them), --draft-vocab is
    saved with the drafter, --amp bfloat16 keeps float32 weights; all three are kept on resume."""
    from dflow_rt.models.draft_vocab import build_draft_vocab, load_draft_vocab

    out = tmp_path / "small"
    args = ["dflash", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(out), *RUN, "--steps", "6",
            "--sequences", "12", "--draft-vocab", "40", "--amp", "bfloat16"]
    assert run_cli([*args, "--run-steps", "3"]) == 0
    out_err = capsys.readouterr()
    assert "12 training sequences of 24, 1 rank(s) x 1 thread(s), draft vocabulary 40" in out_err.out
    assert ("--amp bfloat16 on a CPU without BF16 instructions" in out_err.err) == (not loop.cpu_has_bf16())
    assert run_cli([*args[:-6], "--resume", "--sequences", "13"]) == 2
    assert "conflicting: --sequences 13" in capsys.readouterr().err
    assert run_cli([*args[:-6], "--resume"]) == 0
    seqs = sequences.load_sequences(data_file)
    want, _ = build_draft_vocab(seqs, 260, 40, list(range(12)))
    assert torch.equal(load_draft_vocab(out, 260), want)
    assert not torch.equal(want, build_draft_vocab(seqs, 260, 40)[0])  # other rows would give another set
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.float32}
    records = log(out)
    assert records[0]["train_sequences"] == 12 and records[0]["settings"]["amp"] == "bfloat16"
    assert all(torch.isfinite(torch.tensor(r["loss1"])) for r in records if r["event"] == "draft")
    target = dflow_rt.load_target(tiny_dir)
    drafter = dflow_rt.load_drafter(out, target)
    prompt = seqs[22][:int(seqs.prompt_lens[22])]
    assert dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=30).token_ids == \
        dflow_rt.oracle.generate(target, None, prompt, max_new_tokens=30).token_ids
    bad = ["dflash", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(tmp_path / "x"), *RUN,
           "--steps", "2"]
    assert run_cli([*bad, "--sequences", "21"]) == 2  # 24 rows less 4 held out
    assert run_cli([*bad, "--draft-vocab", "261"]) == 2
    err = capsys.readouterr().err
    assert "--sequences 21" in err and "has 20 training sequences" in err and "1..260" in err


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_init_layers_start_the_drafter_as_copies_of_target_layers(model_type, tmp_path):
    from dflow_rt.train.drafter_training import DFLASH_DEFAULTS, build_drafter
    from dflow_rt.train.loop import run_settings

    torch.manual_seed(0)
    target = Target(TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, model_type=model_type))
    with torch.no_grad():
        for p in target.parameters():
            p.normal_()
    s, _ = run_settings(DFLASH_DEFAULTS, {"steps": 1, "layers": 2, "init_layers": [3, 1]}, tmp_path, False)
    drafter = build_drafter("dflash", target, tmp_path, s)
    for mine, i in zip(drafter.layers, (3, 1), strict=True):
        theirs = target.model.layers[i].state_dict()
        for name, value in mine.state_dict().items():
            want = theirs.get(name, torch.ones_like(value))  # a Llama target has no q/k norms: identity scale
            assert torch.equal(value, want), name
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    for bad in ([3], [3, 4]):
        s["init_layers"] = bad
        with pytest.raises(InputError, match="one per drafter layer"):
            build_drafter("dflash", target, tmp_path, s)
    s.update(init_layers=[3, 1], init=str(tmp_path))
    with pytest.raises(InputError, match="give one of them"):
        build_drafter("dflash", target, tmp_path, s)


# ------------------------------------------------------------------------------------- cached features

def test_cached_features_equal_the_inference_forward_and_train_as_online(tiny_dir, data_file, tmp_path,
                                                                         monkeypatch):
    """`train features` stores, per sequence, the target's own forward features (bf16-rounded); a DFlash
    run on them never runs the target in its updates and follows the online run's losses to bf16
    rounding; a cache of other layers or data is refused."""
    from dflow_rt.train import objective
    from dflow_rt.train.features import load_features

    cache = tmp_path / "feats.safetensors"
    assert run_cli(["features", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(cache),
                    "--layers", "2", "--threads", "1"]) == 0
    feats, target = load_features(cache, tiny_dir, data_file, (2,)), dflow_rt.load_target(tiny_dir)
    seqs = sequences.load_sequences(data_file)
    for i in range(len(seqs)):
        ids = seqs[i][None]
        _, ref = target(ids, torch.arange(ids.shape[1])[None], layer_ids=(2,))
        got = feats[int(seqs.offsets[i]):int(seqs.offsets[i + 1])]
        torch.testing.assert_close(got.float(), ref[0].bfloat16().float(), atol=0.02, rtol=0.02)
    with pytest.raises(InputError, match="layer_ids"):
        load_features(cache, tiny_dir, data_file, (1,))
    with pytest.raises(InputError, match="data_digest"):
        load_features(cache, tiny_dir, tiny_dir / "model.safetensors", (2,))
    with pytest.raises(InputError, match="data_digest"):  # the caller's digests are what is checked
        load_features(cache, tiny_dir, data_file, (2,), {"target_digest": sequences.model_digest(tiny_dir),
                                                         "data_digest": "0" * 16})
    curves, passes, context = {}, [], objective.target_context
    monkeypatch.setattr(objective, "target_context", lambda *a: passes.append(1) or context(*a))
    for name, extra in (("online", []), ("cached", ["--features", str(cache)])):
        out, passes[:] = tmp_path / name, []
        assert run_cli(["dflash", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(out), *RUN,
                        "--steps", "6", *extra]) == 0
        curves[name] = [r["last_loss"] for r in log(out) if r["event"] == "train"]
        curves[name + " passes"] = len(passes)
    assert curves["online passes"] - curves["cached passes"] == 6  # the end-of-run evaluation runs it in both
    assert len(curves["cached"]) == 6 and curves["cached"][-1] < curves["cached"][0]
    torch.testing.assert_close(torch.tensor(curves["cached"]), torch.tensor(curves["online"]), atol=0.05, rtol=0.02)
