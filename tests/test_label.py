"""One-pass labelled data (`train label`): the labels are the target's own argmax (checked against
transformers on the same weights), the features are the training pass's, shards resume, and a DFlash
run trains on the labels rather than on the text."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from dflow_rt.train import label as labelling
from dflow_rt.train import sequences
from dflow_rt.train.features import load_features
from dflow_rt.train.objective import DraftObjective, target_context
from tests.test_train_drafter import RUN, log, run_cli, tiny_dir  # noqa: F401  (tiny_dir is a fixture)


@pytest.fixture(scope="module")
def labelled(tiny_dir):  # noqa: F811
    out, feats = tiny_dir.parent / "labelled.safetensors", tiny_dir.parent / "labelled_feats.safetensors"
    assert run_cli(["label", "--target", str(tiny_dir), "--out", str(out), "--features", str(feats), "--layers", "1,3",
                    "--texts", "24", "--max-tokens", "160", "--threads", "1"]) == 0
    return out, feats


def test_labels_are_the_targets_argmax_and_features_its_pass(tiny_dir, labelled):  # noqa: F811
    out, feats_file = labelled
    seqs = sequences.load_sequences(out)
    assert len(seqs) == 24 and seqs.truth is not None and set(seqs.kinds.tolist()) == {0, 1, 2}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    feats = load_features(feats_file, tiny_dir, out, (1, 3))
    from dflow_rt.models.checkpoint import load_target

    ours = load_target(tiny_dir)
    differs = 0
    for i in range(len(seqs)):
        ids, truth = seqs[i], seqs.truth_of(i)
        assert seqs.prompt_lens[i] + 24 <= len(ids) <= 160
        with torch.no_grad():
            want = hf(ids[None]).logits[0].argmax(-1)
            f, _ = target_context(ours, ids[None], (1, 3))
        assert truth[0] == ids[0] and torch.equal(truth[1:], want[:-1])
        a, b = int(seqs.offsets[i]), int(seqs.offsets[i + 1])
        torch.testing.assert_close(feats[a:b].float(), f[0], atol=2e-2, rtol=2e-2)
        differs += int((truth[1:] != ids[1:]).sum())
    assert differs > 0  # a random target does not write the text: labels and text are told apart


def test_label_resumes_from_its_shards(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    out, feats = tmp_path / "d.safetensors", tmp_path / "f.safetensors"
    text = labelling.LabelText(10, max_tokens=160, shard=4)
    calls = []
    real = labelling.label_batch
    monkeypatch.setattr(labelling, "label_batch", lambda *a, **k: calls.append(1) or real(*a, **k))

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(labelling, "_merge", interrupted)
    with pytest.raises(KeyboardInterrupt):
        labelling.label(tiny_dir, out, feats, (1,), text)
    assert len(list((tmp_path / "d.safetensors.parts").glob("*.safetensors"))) == 3
    (tmp_path / "d.safetensors.parts" / "00000008.safetensors").write_bytes(b"torn")  # a torn shard is redone
    monkeypatch.undo()
    done = len(calls)
    calls.clear()
    monkeypatch.setattr(labelling, "label_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    info = labelling.label(tiny_dir, out, feats, (1,), text)
    assert info["texts"] == 10 and 0 < len(calls) < done and not (tmp_path / "d.safetensors.parts").exists()
    fresh = tmp_path / "fresh.safetensors"
    labelling.label(tiny_dir, fresh, tmp_path / "ff.safetensors", (1,), text)
    a, b = sequences.load_sequences(out), sequences.load_sequences(fresh)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.truth, b.truth)


def test_the_objective_learns_the_truth_not_the_text(tiny_dir, labelled):  # noqa: F811
    """With truth = ids the loss is the regen loss; with the labels it differs, and slot k is scored
    against truth[p + k] while the block starts from the text's token at p."""
    from dflow_rt.models.checkpoint import load_target
    from dflow_rt.train.drafter_training import DFLASH_DEFAULTS, build_drafter
    from dflow_rt.train.loop import run_settings

    out, _ = labelled
    seqs = sequences.load_sequences(out)
    target = load_target(tiny_dir)
    settings, _ = run_settings(DFLASH_DEFAULTS, {"block_size": 8, "layers": 1, "target_layers": [1, 3], "steps": 1},
                                   tiny_dir / "nowhere", False)
    drafter = build_drafter("dflash", target, tiny_dir, settings)
    objective = DraftObjective(drafter, target, gamma=4.0)
    i = int(seqs.lengths().argmax())
    ids, truth = seqs[i][None], seqs.truth_of(i)[None]
    starts, ok = torch.tensor([[20, 30]]), torch.ones(1, 2, dtype=torch.bool)
    lengths = torch.tensor([ids.shape[1]])
    trace_text, trace_truth = [], []
    with torch.no_grad():
        plain, _ = objective(ids, lengths, starts, ok, trace_text)
        same, _ = objective(ids, lengths, starts, ok, truth=ids)
        labelled_loss, stats = objective(ids, lengths, starts, ok, trace_truth, truth=truth)
    assert torch.equal(plain, same) and not torch.equal(plain, labelled_loss)
    drafts = trace_truth[0]["drafts"]
    for n, p in enumerate(starts[0].tolist()):
        hits = drafts[0, n] == truth[0, p + 1:p + 8]
        assert int(trace_truth[0]["accepted"][0, n]) == int(hits.long().cumprod(0).sum())


def test_dflash_trains_on_labelled_text_with_its_features(tiny_dir, labelled):  # noqa: F811
    out, feats = labelled
    run = tiny_dir.parent / "dflash_labelled"
    assert run_cli(["dflash", "--target", str(tiny_dir), "--data", str(out), "--features", str(feats), "--out",
                    str(run), *RUN, "--target-layers", "1,3", "--steps", "6"]) == 0
    draft = [r for r in log(run) if r["event"] == "draft"]
    config = json.loads((run / "config.json").read_text())
    assert len(draft) == 6 and config["dflash_config"]["target_layer_ids"] == [1, 3]
