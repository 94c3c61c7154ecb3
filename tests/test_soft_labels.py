"""Soft labels (`train features --topk`, `train dflash --distill`) and the oracle relay of the objective.

Checked against plain torch: the target's own softmax for the stored top-k, a hand-written cross-entropy
against those probabilities for the distillation loss, and the target's clean pass for the oracle relay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import dflow_rt
from dflow_rt.errors import InputError
from dflow_rt.train import sequences
from dflow_rt.train.features import load_features, load_soft_labels
from dflow_rt.train.objective import DraftObjective, draft_hidden, drafter_context, target_context
from tests.helpers import random_relay
from tests.test_train_drafter import CASES, RUN, data_file, dflash_run, log, run_cli, sequence, tiny_dir  # noqa: F401


def test_topk_file_holds_the_target_softmax_and_the_same_features(tiny_dir, data_file, tmp_path):  # noqa: F811
    plain, soft = tmp_path / "plain.safetensors", tmp_path / "soft.safetensors"
    for out, extra in ((plain, []), (soft, ["--topk", "4"])):
        assert run_cli(["features", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(out),
                        "--layers", "2", "--threads", "1", *extra]) == 0
    torch.testing.assert_close(load_features(soft, tiny_dir, data_file, (2,)),
                               load_features(plain, tiny_dir, data_file, (2,)), atol=0.02, rtol=0.02)
    ids, probs = load_soft_labels(soft)
    target, seqs = dflow_rt.load_target(tiny_dir), sequences.load_sequences(data_file)
    for i in range(0, len(seqs), 5):
        row = seqs[i][None]
        logits, _ = target(row, torch.arange(row.shape[1])[None])
        want = logits[0].softmax(-1)
        span = slice(int(seqs.offsets[i]), int(seqs.offsets[i + 1]))
        torch.testing.assert_close(probs[span], want.gather(-1, ids[span].long()), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(probs[span, 0], want.max(-1).values, atol=1e-5, rtol=1e-4)
        assert (probs[span][:, :-1] >= probs[span][:, 1:]).all()
    with pytest.raises(InputError, match="--topk"):
        load_soft_labels(plain)


def test_distillation_loss_is_the_hand_written_mix_of_hard_and_soft_cross_entropy(reference_pair):
    target, drafter = reference_pair
    ids = sequence(CASES[0], target, drafter)
    L, B = ids.shape[1], drafter.block_size
    starts, ok = torch.tensor([[2, 11, L - B]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        logits, _ = target(ids, torch.arange(L)[None])
        probs, top = logits.softmax(-1).topk(5, dim=-1)
        trace = []
        hard, _ = DraftObjective(drafter, target, gamma=7.0)(ids, torch.tensor([L]), starts, ok, trace)
        mixed, _ = DraftObjective(drafter, target, gamma=7.0, distill=0.25)(ids, torch.tensor([L]), starts, ok,
                                                                             soft=(top, probs))
        one_hot = (ids[..., None].roll(-1, dims=1), torch.ones(1, L, 1))  # the next token with probability 1
        same, _ = DraftObjective(drafter, target, gamma=7.0, distill=1.0)(ids, torch.tensor([L]), starts, ok,
                                                                          soft=one_hot)
        feats, _ = target_context(target, ids, drafter.target_layer_ids)
    torch.testing.assert_close(same, hard, atol=1e-5, rtol=1e-5)
    w = torch.exp(-torch.arange(B - 1) / 7.0)
    block = torch.full((1, 3, B), drafter.config.mask_token_id)
    block[..., 0] = ids[0, starts[0]]
    with torch.no_grad():
        hidden = draft_hidden(drafter, drafter_context(drafter, feats), target.embed_tokens(block.flatten(1)), starts)
        q = target.lm_head(hidden).view(3, B, -1)[:, 1:].log_softmax(-1)
    manual = []
    for n, p in enumerate(starts[0].tolist()):
        hard_ce = F.nll_loss(q[n], ids[0, p + 1:p + B], reduction="none")
        src = torch.arange(p, p + B - 1)  # slot k's distribution: the target's at position p + k - 1
        pk = probs[0, src] / probs[0, src].sum(-1, keepdim=True)
        soft_ce = -(pk * q[n].gather(-1, top[0, src])).sum(-1)
        manual.append(((0.75 * hard_ce + 0.25 * soft_ce) * w).sum() / w.sum())
    torch.testing.assert_close(mixed, torch.stack(manual).mean(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mixed, hard)


def test_oracle_relay_carries_the_clean_pass_states_of_the_true_tokens(reference_pair):
    """The oracle relay's states are the target's clean-pass features of x_p..x_{p+B-1}; a, c and d
    (the first rejected draft) stay those of the real verify."""
    target, drafter = reference_pair[0], random_relay(reference_pair[1])
    ids = sequence(CASES[1], target, drafter)
    L, B = ids.shape[1], drafter.block_size
    starts, ok = torch.tensor([[len(CASES[1]["prompt_ids"])]]), torch.ones(1, 1, dtype=torch.bool)
    runs = {}
    for oracle in (False, True):
        trace = []
        with torch.no_grad():
            DraftObjective(drafter, target, 7.0, rounds=2, oracle_relay=oracle)(ids, torch.tensor([L]), starts, ok,
                                                                               trace)
        runs[oracle] = trace[0]
    real, oracle = runs[False]["relay"], runs[True]["relay"]
    assert int(runs[False]["accepted"]) < B - 1  # a rejected suffix: the real states differ from the clean ones
    for name in ("accepted", "bonus", "rejected", "width"):
        assert torch.equal(getattr(real, name), getattr(oracle, name)), name
    with torch.no_grad():
        feats, _ = target_context(target, ids, drafter.target_layer_ids)
    p = int(starts[0, 0])
    torch.testing.assert_close(oracle.features[0, :B], feats[0, p:p + B].to(oracle.features.dtype), atol=1e-4,
                               rtol=1e-4)
    assert not torch.allclose(real.features[0, :B], oracle.features[0, :B], atol=1e-3)


def test_distill_trains_from_a_topk_file_and_is_refused_without_one(tiny_dir, data_file, tmp_path, capsys):  # noqa: F811
    soft, plain = tmp_path / "soft.safetensors", tmp_path / "plain.safetensors"
    assert run_cli(["features", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(soft),
                    "--layers", "2", "--topk", "4", "--threads", "1"]) == 0
    assert run_cli(["features", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(plain),
                    "--layers", "2", "--threads", "1"]) == 0
    base = ["dflash", "--target", str(tiny_dir), "--data", str(data_file), *RUN, "--steps", "6",
            "--target-layers", "2"]
    out = tmp_path / "kd"
    assert run_cli([*base, "--out", str(out), "--features", str(soft), "--distill", "0.5"]) == 0
    losses = [r["last_loss"] for r in log(out) if r["event"] == "train"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    for extra, why in ((["--features", str(plain)], "no soft labels"), ([], "--topk"),
                       (["--features", str(soft), "--distill", "1.5"], "in \\[0, 1\\]")):
        if "--distill" not in extra:
            extra = [*extra, "--distill", "0.5"]
        assert run_cli([*base, "--out", str(tmp_path / "bad"), *extra]) != 0
        assert why.replace("\\", "") in capsys.readouterr().err


def test_oracle_relay_training_flag_changes_what_the_relay_learns(tiny_dir, data_file, dflash_run, tmp_path):  # noqa: F811
    weights = {}
    for name, extra in (("real", []), ("oracle", ["--oracle-relay"])):
        out = tmp_path / name
        assert run_cli(["dflow", "--target", str(tiny_dir), "--data", str(data_file), "--out", str(out), *RUN,
                        "--init", str(dflash_run), "--freeze-base", "--steps", "3", *extra]) == 0
        assert log(out)[0]["settings"]["oracle_relay"] is bool(extra)
        weights[name] = load_file(out / "model.safetensors")
    relay = [k for k in weights["real"] if "relay" in k]
    assert relay and any(not torch.equal(weights["real"][k], weights["oracle"][k]) for k in relay)
    assert all(torch.equal(weights["real"][k], weights["oracle"][k]) for k in weights["real"] if k not in relay)
