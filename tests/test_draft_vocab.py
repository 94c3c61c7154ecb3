"""Draft vocabulary: drafts come from the restricted head exactly as from the full head masked to the
set, decoding stays lossless, and the file round-trips through the CLI, the loader and save_model."""

import json
import shutil
from collections import Counter

import pytest
import torch

import dflow_rt
import dflow_rt.oracle
from dflow_rt.commands.main import main
from dflow_rt.engine.runtime import Runtime
from dflow_rt.errors import CheckpointError, InputError
from dflow_rt.models.checkpoint import load_drafter, save_model
from dflow_rt.models.draft_vocab import FILE, build_draft_vocab, load_draft_vocab
from dflow_rt.train.sequences import load_sequences, save_sequences
from tests.conftest import FIXTURES, load_pair
from tests.helpers import fixed

CASES = json.loads((FIXTURES / "rounds.json").read_text())["cases"]


def write_sequences(path, seqs, prompt_lens):
    save_sequences(path, seqs, prompt_lens, [0] * len(seqs), {"vocab_size": 50})
    return load_sequences(path)


def test_build_ranks_by_frequency_then_id_and_reports_coverage(tmp_path):
    seqs = [[5, 5, 9, 1, 9, 9, 7], [2, 2, 3, 9, 4]]
    data = write_sequences(tmp_path / "d.safetensors", seqs, [2, 3])
    counts = Counter(t for s in seqs for t in s)  # 9: 4, 5: 2, 2: 2, then 1, 3, 4, 7 once
    expected = sorted(sorted(range(50), key=lambda t: (-counts[t], t))[:4])
    ids, coverage = build_draft_vocab(data, 50, 4)
    assert ids.tolist() == expected == [1, 2, 5, 9]
    written = seqs[0][2:] + seqs[1][3:]  # 9 1 9 9 7 | 9 4
    assert coverage == pytest.approx(sum(t in expected for t in written) / len(written))
    for bad in (0, 51):
        with pytest.raises(InputError, match="size must be in 1..50"):
            build_draft_vocab(data, 50, bad)
    with pytest.raises(InputError, match="outside the vocabulary"):
        build_draft_vocab(data, 8, 4)
    ids, coverage = build_draft_vocab(data, 50, 4, rows=[1])  # counts row 1 only: 2 twice, then 3 4 9 once
    assert ids.tolist() == [2, 3, 4, 9] and coverage == 1.0


def test_restricted_drafts_are_the_masked_full_head_argmax():
    target, drafter = load_pair(FIXTURES)
    vocab = target.config.vocab_size
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:vocab // 3].sort().values
    prompt = torch.tensor([CASES[0]["prompt_ids"]])
    P, B = prompt.shape[1], drafter.block_size
    with torch.inference_mode():
        _, feat = target(prompt, torch.arange(P)[None], target.new_cache(1, P + B), layer_ids=drafter.target_layer_ids)
        block = torch.full((1, B), drafter.config.mask_token_id)
        block[0, 0] = CASES[0]["output_ids"][0]
        pos = torch.arange(P, P + B)[None]

        def drafts():
            return drafter.propose(target, block, pos, cache=drafter.new_cache(1, P + B), ctx_feat=feat,
                                   ctx_pos=torch.arange(P)[None])

        full = drafts()
        hidden = drafter(drafter.embed(target, block), pos, cache=drafter.new_cache(1, P + B), ctx_feat=feat,
                         ctx_pos=torch.arange(P)[None])
        logits = target.lm_head(hidden[:, 1:])
        masked = logits.masked_fill(~torch.isin(torch.arange(vocab), ids), float("-inf")).argmax(-1)
        drafter.restrict_vocab(target, ids)
        restricted = drafts()
        drafter.restrict_vocab(target, None)
        assert torch.equal(drafts(), full) and torch.equal(full, logits.argmax(-1))
    assert torch.equal(restricted, masked) and torch.isin(restricted, ids).all()
    assert not torch.equal(restricted, full)  # the set really removed some greedy drafts


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_decoding_with_a_draft_vocabulary_is_lossless(mode):
    target, drafter = load_pair(FIXTURES)
    vocab = target.config.vocab_size
    drafter.restrict_vocab(target, torch.arange(0, vocab, 2))  # half the vocabulary: many drafts change
    cases = [CASES[2], CASES[4]]  # the prompts the drafter drafts well: 16 and 6.5 tokens a round
    prompts = [c["prompt_ids"] for c in cases]
    config = fixed(max_batch=2, max_len=160, mode=mode, compiler="aot_eager", sampling=False)  # greedy requests
    outs = Runtime(target, drafter, config).generate(prompts, max_new_tokens=64)
    changed = 0
    for prompt, out, case in zip(prompts, outs, cases, strict=True):
        ref = dflow_rt.oracle.generate(target, drafter, prompt, max_new_tokens=64)
        assert out == ref.token_ids == case["output_ids"]
        changed += ref.acceptance_lengths != case["acceptance_lengths"]
    assert changed  # the set changed drafts, and the output did not change


def test_cli_writes_it_and_load_and_save_keep_it(tmp_path, capsys):
    target, _ = load_pair(FIXTURES)
    vocab = target.config.vocab_size
    directory = tmp_path / "drafter"
    shutil.copytree(FIXTURES / "drafter", directory)
    seqs = [c["prompt_ids"] + c["output_ids"] for c in CASES]
    write_sequences(tmp_path / "data.safetensors", seqs, [len(c["prompt_ids"]) for c in CASES])
    assert main(["train", "draft-vocab", "--drafter", str(directory), "--data", str(tmp_path / "data.safetensors"),
                 "--size", "20"]) == 0
    assert f"20 of {vocab} tokens" in capsys.readouterr().out
    ids = load_draft_vocab(directory, vocab)
    assert len(ids) == 20 and torch.equal(ids, ids.sort().values)
    drafter = load_drafter(directory, target)
    assert torch.equal(drafter.vocab_ids, ids)
    assert torch.equal(drafter.vocab_head, target.lm_head.weight[ids])
    assert load_drafter(directory, target, draft_vocab=False).vocab_ids is None
    assert load_drafter(FIXTURES / "drafter", target).vocab_ids is None  # no file: the whole vocabulary
    save_model(drafter, tmp_path / "copy")
    assert torch.equal(load_draft_vocab(tmp_path / "copy", vocab), ids)
    for bad in ('{"token_ids": [1, 1]}', f'{{"token_ids": [{vocab}]}}', '{"token_ids": []}', "{", "[]"):
        (directory / FILE).write_text(bad)
        with pytest.raises(CheckpointError, match="draft vocabulary|token_ids"):
            load_drafter(directory, target)
