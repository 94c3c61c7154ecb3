"""`dflow-rt train ...`: the training pipeline's commands (tokenizer, target, regen, label, features, dflash,
dflow, draft-vocab).

`add_train_parser(subparsers)` plugs them into the main CLI; `python -m dflow_rt.commands.train ...`
runs them standalone (also the form to launch under `torchrun`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dflow_rt.errors import DflowError
from dflow_rt.train.settings import TARGET_DEFAULTS


def cmd_tokenizer(args: argparse.Namespace) -> None:
    from dflow_rt.data.corpus import tokenizer_sample
    from dflow_rt.tokenizer import train_tokenizer

    t0 = time.perf_counter()
    texts = tokenizer_sample(int(args.sample_mb * 1e6))
    tokenizer = train_tokenizer(texts, args.vocab_size)
    out = Path(args.out)
    tokenizer.save_pretrained(out)
    chars = sum(map(len, texts))
    tokens = sum(map(len, tokenizer(texts, add_special_tokens=False)["input_ids"]))
    print(f"wrote {out}: {len(tokenizer)} tokens, {chars / tokens:.2f} characters per token on its "
          f"{chars / 1e6:.1f} MB sample ({time.perf_counter() - t0:.0f} s)")


def cmd_target(args: argparse.Namespace) -> None:
    from dflow_rt.train.pretrain_target import train_target

    given = {k: getattr(args, k) for k in TARGET_DEFAULTS}
    result = train_target(args.tokenizer, args.out, run_options(args), **given)
    if result["finished"]:
        print(f"wrote {args.out} after {result['step']} steps ({result['tokens'] / 1e6:.1f}M tokens)")
    else:
        print(f"stopped at step {result['step']}; continue with --resume")


def _loop_args(p: argparse.ArgumentParser, optimisation) -> argparse._ArgumentGroup:
    """Budget and run options of the shared training loop; returns the "run" group to extend."""
    budget = optimisation.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimizer steps")
    budget.add_argument("--minutes", type=float, help="wall-clock budget, turned into a step count after 20 steps")
    run = p.add_argument_group("run")
    run.add_argument("--resume", action="store_true", help="continue exactly from OUT/checkpoint")
    run.add_argument("--threads", type=int, help="torch threads per process [cores / processes]")
    run.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints [500]")
    run.add_argument("--log-every", type=int, default=10, help="steps between train_log.jsonl records [10]")
    run.add_argument("--run-steps", type=int, help="stop with a checkpoint after this many steps of this invocation")
    return run


def run_options(args: argparse.Namespace):
    """The run group's flags (`_loop_args`) plus --batch and --device, as the trainers take them."""
    from dflow_rt.train.loop import RunOptions

    return RunOptions(batch=args.batch, resume=args.resume, threads=args.threads,
                      checkpoint_every=args.checkpoint_every, log_every=args.log_every, run_steps=args.run_steps,
                      device=getattr(args, "device", "cpu"))


def _target_parser(p: argparse.ArgumentParser) -> None:
    d = TARGET_DEFAULTS
    p.add_argument("--tokenizer", required=True, help="directory written by `dflow-rt train tokenizer`")
    p.add_argument("--out", required=True, help="output model directory (checkpoint/ and train_log.jsonl inside)")
    size = p.add_argument_group("model (defaults in brackets; a resumed run keeps its own)")
    for flag, kind, text in (("layers", int, "decoder layers"), ("hidden", int, "hidden size"),
                             ("heads", int, "attention heads"), ("kv-heads", int, "key/value heads"),
                             ("ffn", int, "MLP intermediate size"), ("seq-len", int, "tokens per sequence")):
        size.add_argument(f"--{flag}", type=kind, help=f"{text} [{d[flag.replace('-', '_')]}]")
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--batch", type=int, default=16, help="sequences per step per rank (global = x world size)")
    opt.add_argument("--lr", type=float, help=f"peak AdamW learning rate [{d['lr']}]")
    opt.add_argument("--min-lr-ratio", type=float, help=f"cosine floor as a fraction of --lr [{d['min_lr_ratio']}]")
    opt.add_argument("--warmup", type=int, help=f"linear warm-up steps [{d['warmup']}]")
    opt.add_argument("--weight-decay", type=float, help=f"[{d['weight_decay']}]")
    opt.add_argument("--clip", type=float, help=f"gradient-norm clip [{d['clip']}]")
    opt.add_argument("--seed", type=int, help="initialisation and data order [0]")
    _loop_args(p, opt)
    data = p.add_argument_group("data")
    data.add_argument("--eval-windows", type=int, help=f"held-out sequences per source [{d['eval_windows']}]")
    data.add_argument("--math-per-epoch", type=int, help=f"plain word problems per epoch [{d['math_per_epoch']}]")
    data.add_argument("--math-chat-per-epoch", type=int,
                      help=f"chat-form word problems per epoch [{d['math_chat_per_epoch']}]")
    data.add_argument("--max-files", type=int, help="use only the first N stdlib files (smoke tests)")
    p.set_defaults(run=cmd_target)


def cmd_regen(args: argparse.Namespace) -> None:
    from dflow_rt.models.bundled import target_dir
    from dflow_rt.train.regen import RegenSettings, regenerate

    t0 = time.perf_counter()
    settings = RegenSettings(prompts=args.prompts, max_new_tokens=args.max_new_tokens, seed=args.seed,
                             batch=args.batch, max_prompt_tokens=args.max_prompt_tokens, stop_tail=args.stop_tail,
                             first_prompt=args.first_prompt, mix=args.mix)
    out = regenerate(target_dir(args.target), args.out, settings, threads=args.threads, device=args.device)
    print(f"wrote {out}: {args.prompts} sequences ({time.perf_counter() - t0:.0f} s)")


def _regen_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory (with its tokenizer)")
    p.add_argument("--out", required=True, help="output .safetensors file (OUT.partial holds progress; rerun resumes)")
    p.add_argument("--prompts", type=int, default=2000, help="training prompts: 40%% code, 30%% math, 30%% chat [2000]")
    p.add_argument("--max-new-tokens", type=int, default=256, help="greedy tokens per prompt [256]")
    p.add_argument("--seed", type=int, default=0, help="prompt selection [0]")
    p.add_argument("--mix", choices=("project", "broad"), default="project",
                   help="prompt sources: the project's own generators, or broad: code tasks from installed "
                        "packages' docstrings, word problems of many kinds and phrasings, requests over many "
                        "topics (dflow_rt.data.broad) [project]")
    p.add_argument("--first-prompt", type=int, default=0,
                   help="start at this training prompt: a later range of the same seed is fresh data [0]")
    p.add_argument("--batch", type=int, default=16, help="prompts decoded together [16]")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="longer prompts keep their end [128]")
    p.add_argument("--stop-tail", type=int, default=16, help="tokens kept after the first stop token [16]")
    p.add_argument("--threads", type=int, help="torch threads [all cores]")
    p.add_argument("--device", default="cpu", help="cpu or cuda [cpu]")
    p.set_defaults(run=cmd_regen)


def cmd_join(args: argparse.Namespace) -> None:
    from dflow_rt.train.regen import join_regen

    out = join_regen(args.parts, args.out)
    print(f"wrote {out}: {len(args.parts)} parts joined")


def cmd_label(args: argparse.Namespace) -> None:
    from dflow_rt.models.bundled import target_dir
    from dflow_rt.train.label import LabelText, label

    t0 = time.perf_counter()
    kinds = tuple(("code", "math", "chat").index(k) for k in args.kinds.split(","))
    info = label(target_dir(args.target), args.out, args.features, tuple(int(i) for i in args.layers.split(",")),
                 LabelText(args.texts, seed=args.seed, kinds=kinds, max_tokens=args.max_tokens),
                 threads=args.threads, device=args.device, dtype=args.target_dtype)
    print(f"wrote {args.out} and {args.features}: {info['texts']} texts, {info['tokens']} tokens; the target "
          f"agrees with the text at {info['agree']:.1%} of the supervised positions ({time.perf_counter() - t0:.0f} s)")


def _label_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="frozen target model directory (or a fetched model's name)")
    p.add_argument("--out", required=True, help="output sequence file (OUT.parts/ holds progress; rerun resumes)")
    p.add_argument("--features", required=True, help="output features file, as `train features` writes it")
    p.add_argument("--layers", required=True, help="comma-separated conditioning layers: the drafter's --target-layers")
    p.add_argument("--texts", type=int, default=2000, help="texts to label [2000]")
    p.add_argument("--kinds", default="code,math,chat,code,math,chat,code,chat,math,code",
                   help="the cycle of text kinds, one per text [40%% code, 30%% math, 30%% chat]")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per text at most [512]")
    p.add_argument("--seed", type=int, default=0, help="text selection [0]")
    p.add_argument("--target-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the target's dtype: bfloat16 labels ~3x faster on a CPU with BF16 [float32]")
    p.add_argument("--threads", type=int, help="torch threads [all cores]")
    p.add_argument("--device", default="cpu", help="cpu or cuda [cpu]")
    p.set_defaults(run=cmd_label)


def cmd_features(args: argparse.Namespace) -> None:
    from dflow_rt.models.bundled import target_dir
    from dflow_rt.train.features import write_features

    t0 = time.perf_counter()
    layer_ids = tuple(int(i) for i in args.layers.split(","))
    out = write_features(target_dir(args.target), args.data, args.out, layer_ids, threads=args.threads,
                         device=args.device, topk=args.topk)
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")


def _features_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="frozen target model directory (or a fetched model's name)")
    p.add_argument("--data", required=True, help="sequences written by `dflow-rt train regen`")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--layers", required=True,
                   help="comma-separated conditioning layers: the drafter's --target-layers (a 2-layer drafter of a "
                   "30-layer target: 1,27)")
    p.add_argument("--topk", type=int, default=0,
                   help="also store the top K of the target's next-token softmax at each position, the soft labels "
                   "of `train dflash --distill` (runs the whole target) [0: none]")
    p.add_argument("--threads", type=int, help="torch threads [all cores]")
    p.add_argument("--device", default="cpu", help="cpu or cuda [cpu]")
    p.set_defaults(run=cmd_features)


def cmd_drafter(args: argparse.Namespace) -> None:
    from dflow_rt.models.bundled import target_dir
    from dflow_rt.train.drafter_training import DFLASH_DEFAULTS, DFLOW_DEFAULTS, train_drafter

    names = DFLOW_DEFAULTS if args.train_command == "dflow" else DFLASH_DEFAULTS
    given = {k: getattr(args, k) for k in names}
    for key in ("target_layers", "init_layers"):
        if given[key] is not None:
            given[key] = [int(i) for i in given[key].split(",")]
    if given["gamma"] not in (None, "auto"):
        given["gamma"] = float(given["gamma"])
    result = train_drafter(args.train_command, target_dir(args.target), args.data, args.out, run_options(args),
                           (args.eval_prompts, args.eval_max_new_tokens), args.features, **given)
    if result["finished"]:
        print(f"wrote {args.out} after {result['step']} steps")
    else:
        print(f"stopped at step {result['step']}; continue with --resume")


def cmd_draft_vocab(args: argparse.Namespace) -> None:
    from dflow_rt.models.checkpoint import drafter_config, read_config
    from dflow_rt.models.draft_vocab import build_draft_vocab, save_draft_vocab
    from dflow_rt.train.sequences import file_digest, load_sequences

    path, cfg = read_config(args.drafter)
    vocab = drafter_config(cfg, path).vocab_size
    seqs = load_sequences(args.data)
    ids, coverage = build_draft_vocab(seqs, vocab, args.size)
    out = save_draft_vocab(args.drafter, ids, data=Path(args.data).name, data_digest=file_digest(args.data),
                           coverage=round(coverage, 5))
    print(f"wrote {out}: {len(ids)} of {vocab} tokens, covering {coverage:.2%} of the tokens the target wrote "
          f"in {len(seqs)} sequences")


def _drafter_parser(p: argparse.ArgumentParser, dflow: bool) -> None:
    """Defaults in brackets are DFLASH_DEFAULTS / DFLOW_DEFAULTS of dflow_rt.train.drafter_training."""
    p.add_argument("--target", required=True, help="frozen target model directory")
    p.add_argument("--data", required=True, help="sequences written by `dflow-rt train regen`")
    p.add_argument("--features", help="the target's features of --data from `dflow-rt train features`: DFlash "
                   "updates then never run the target")
    p.add_argument("--out", required=True, help="output drafter directory (checkpoint/ and train_log.jsonl inside)")
    m = p.add_argument_group("drafter (a resumed run keeps its own)")
    m.add_argument("--init", help=("start from this DFlash (converted with a zero-init relay) or DFlow drafter"
                                   if dflow else "continue this DFlash drafter (fresh optimizer and schedule)")
                   + "; it fixes the shape (--layers, --target-layers, ... may only repeat its own); "
                     "--block-size re-blocks its weights")
    if dflow:
        m.add_argument("--relay-hidden", type=int, help="relay MLP width [target hidden size]")
        m.add_argument("--relay-input", choices=("mask_embedding", "kv"),
                       help="relay added to the mask embeddings, or attended as keys/values [mask_embedding]")
        m.add_argument("--relay-lr-scale", type=float, help="relay learning rate / --lr [1.0]")
        m.add_argument("--base-lr-scale", type=float,
                       help="learning rate of the DFlash weights / --lr; 0 trains the relay alone [1.0]")
        m.add_argument("--rounds", type=int, help="rounds unrolled per anchor [3]")
        m.add_argument("--base-first-round", action="store_const", const=True,
                       help="the DFlash weights learn from round 1 (the DFlash loss) alone, the relay from the "
                       "later rounds, each clipped apart: the relay-off drafter gets DFlash updates")
        m.add_argument("--oracle-relay", action="store_const", const=True,
                       help="an experiment, not a drafter to deploy: the relay learns from the target's states of "
                       "the true continuation, which no inference round has (docs/experiments.md: the oracle relay)")
        m.add_argument("--freeze-base", action="store_const", const=True,
                       help="the relay alone, as --base-lr-scale 0 but ~1.2x faster: the DFlash weights get no "
                       "gradient, so the gradient clip's norm is the relay's alone")
    m.add_argument("--block-size", type=int, help="B [16]")
    m.add_argument("--layers", type=int, help="drafter decoder layers [2]")
    m.add_argument("--target-layers", help="comma-separated conditioning layers [build_target_layer_ids]")
    m.add_argument("--mask-token-id", type=int, help="[the tokenizer's <|MASK|>, else vocab - 1]")
    m.add_argument("--init-layers", help="comma-separated target layers the drafter's layers start as copies of "
                   "(one per drafter layer; the target's layer shape) [random]")
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch", type=int, default=4, help="sequences per step per rank [4]")
    o.add_argument("--anchors", type=int, help="anchor blocks per sequence [32]")
    o.add_argument("--lr", type=float, help="peak AdamW learning rate [1e-3]")
    o.add_argument("--gamma", help="loss decay exp(-(k-1)/gamma); auto: 7 for B=16, 4 for B=8 [auto]")
    o.add_argument("--warmup", type=int, help="[50]")
    o.add_argument("--min-lr-ratio", type=float, help="[0.1]")
    o.add_argument("--weight-decay", type=float, help="[0.01]")
    o.add_argument("--clip", type=float, help="[1.0]")
    o.add_argument("--seed", type=int, help="initialisation, data order and anchors [0]")
    o.add_argument("--eval-seqs", type=int, help="sequences at the end of --data held out for eval [16]")
    o.add_argument("--sequences", type=int, help="train on the first N sequences of --data only (a learning curve "
                   "over one file and its features) [all but --eval-seqs]")
    o.add_argument("--draft-vocab", type=int, help="draft (and learn) only the N tokens the training sequences "
                   "use most: the head's cost in an update falls by vocab / N; 0 keeps the whole vocabulary. "
                   "Saved with the drafter as draft_vocab.json [0]")
    o.add_argument("--distill", type=float, help="weight of the target's soft labels in each slot's loss (the rest "
                   "on the hard label): needs --features written with --topk [0]")
    r = _loop_args(p, o)
    r.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for real tau at checkpoints [8]")
    r.add_argument("--eval-max-new-tokens", type=int, default=64, help="tokens generated per eval prompt [64]")
    r.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: each rank's own GPU, nccl) [cpu]")
    r.add_argument("--target-dtype", choices=("float32", "bfloat16"),
                   help="dtype of the frozen target; the drafter trains in float32 either way [float32]")
    r.add_argument("--amp", choices=("float32", "bfloat16"),
                   help="the updates' matrix products in this dtype (torch.autocast; weights and optimizer stay "
                   "float32): bfloat16 is ~2x faster on a CPU with BF16 instructions or a GPU [float32]")
    p.set_defaults(run=cmd_drafter)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register `train` (sub-commands `tokenizer`, `target`, `regen`, `join`, `label`, `features`, `dflash`, `dflow`,
    `draft-vocab`) on the main CLI."""
    train = subparsers.add_parser("train", help="train the tokenizer, the target and drafters")
    sub = train.add_subparsers(dest="train_command", required=True)
    tok = sub.add_parser("tokenizer", help="train the byte-level BPE on a sample of the training text")
    tok.add_argument("--out", required=True)
    tok.add_argument("--vocab-size", type=int, default=2048)
    tok.add_argument("--sample-mb", type=float, default=3.0, help="characters of training text to learn from [3 MB]")
    tok.set_defaults(run=cmd_tokenizer)
    _target_parser(sub.add_parser("target", help="pretrain the target from scratch (DDP under torchrun)"))
    _regen_parser(sub.add_parser("regen", help="drafter training data: the target's greedy continuations"))
    join = sub.add_parser("join", help="join regen files of consecutive --first-prompt ranges into one")
    join.add_argument("parts", nargs="+", help="regen files, in prompt order")
    join.add_argument("--out", required=True, help="output .safetensors file")
    join.set_defaults(run=cmd_join)
    _label_parser(sub.add_parser("label", help="drafter training data at prefill speed: text labelled with the "
                                 "target's argmax in one pass, with its features"))
    _features_parser(sub.add_parser("features", help="cache the target's conditioning features of regen data"))
    _drafter_parser(sub.add_parser("dflash", help="train a DFlash drafter (DDP under torchrun)"), dflow=False)
    _drafter_parser(sub.add_parser("dflow", help="DFlow self-condition training of a relay drafter"), dflow=True)
    v = sub.add_parser("draft-vocab", help="restrict a drafter's drafts to the tokens its target writes most "
                       "(a smaller head read per draft pass; lossless)")
    v.add_argument("--drafter", required=True, help="drafter directory: draft_vocab.json is written there")
    v.add_argument("--data", required=True, help="sequences written by `dflow-rt train regen` for its target")
    v.add_argument("--size", type=int, default=8192, help="tokens kept, most frequent first [8192]")
    v.set_defaults(run=cmd_draft_vocab)
    return train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflow-rt")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    try:
        args.run(args)
    except DflowError as err:  # as the main CLI reports them
        print(f"dflow-rt: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun every file is written and the process group left by now. Skip the interpreter's
        # teardown: DDP's reference cycles keep gloo's worker threads alive into it, where their C++
        # destructors can abort ("terminate called without an active exception") and fail the whole run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
