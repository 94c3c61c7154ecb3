"""`dflow-rt` command line: generate text, make demo models."""

from __future__ import annotations

import argparse
import json
import sys

from dflow_rt.commands.common import (
    KERNELS_PENDING,
    add_start_args,
    add_tuned_args,
    build_in_background,
    load_decoding_models,
    load_models_from,
    model_args,
    runtime_config,
)
from dflow_rt.config import DTYPES, MODES
from dflow_rt.errors import DflowError


def cmd_generate(args: argparse.Namespace) -> None:
    import time

    import torch

    from dflow_rt.checks import check_fits
    from dflow_rt.engine.generation import run_one
    from dflow_rt.engine.runtime import Runtime
    from dflow_rt.tokenizer import stop_token_ids

    target, drafter, tokenizer = load_decoding_models(args)
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                            add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    block = 1 if drafter is None else (args.block_size or drafter.block_size)
    check_fits(len(ids), args.max_new_tokens, block, target.config.max_position_embeddings)  # before allocating
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    config = runtime_config(args, max_batch=1, max_len=len(ids) + args.max_new_tokens + block,
                            sampling=args.temperature > 0)  # greedy: half the graphs to compile
    t0 = time.perf_counter()
    rt = Runtime(target, drafter, config)
    setup_s = time.perf_counter() - t0
    if args.build_rounds:
        return  # built and on disk: the process that started this one answered already
    out = run_one(rt, ids, args.max_new_tokens, stop_token_ids(tokenizer), **sampling)
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    stats = {"tau": round(out.tau, 4), "tokens_per_s": round(out.decode_tokens_per_s, 2),
             "rounds": len(out.acceptance_lengths), "plain_steps": out.plain_steps,
             "lookup_rounds": out.lookup_rounds, "lookup_tokens": out.lookup_tokens}
    if args.json:
        print(json.dumps({"text": text, "token_ids": out.token_ids, "prompt_ids": list(ids),
                          "acceptance_lengths": out.acceptance_lengths, **stats, "mode": rt.config.mode,
                          "verify_width": rt.config.verify_width, "ar_fallback": rt.plan.ar_fallback,
                          "lookup": rt.plan.lookup,
                          "threads": torch.get_num_threads(),
                          "dtype": str(target.lm_head.weight.dtype).removeprefix("torch."),
                          "compile_pending": rt.compile_pending,
                          "setup_s": round(setup_s, 4), "first_step_s": round(out.first_step_seconds, 4),
                          "decode_s": round(out.decode_seconds, 4)}))
    else:
        print(text)
        plain = f" ({out.plain_steps} plain target steps: drafting did not pay)" if out.plain_steps and drafter else ""
        plain += f" ({out.lookup_rounds} lookup rounds: {out.lookup_tokens} tokens)" if out.lookup_rounds else ""
        print(f"\ntau {stats['tau']:.2f} | decode {stats['tokens_per_s']:.1f} tokens/s | "
              f"{stats['rounds']} rounds{plain}",
              file=sys.stderr if args.quiet_stats else sys.stdout)
    if rt.compile_pending:
        build_in_background(args.argv, "this answer ran on eager rounds" + KERNELS_PENDING * rt.kernels_pending)


def cmd_eval_tau(args: argparse.Namespace) -> None:
    from dflow_rt.data.prompts import suite_names, suite_prompts
    from dflow_rt.eval.diagnose import relay_diagnostics
    from dflow_rt.eval.tau import measure_tau
    from dflow_rt.models.drafter import relay_off
    from dflow_rt.tokenizer import stop_token_ids

    args.drafter = args.drafter or "dflash"
    target, drafter, tokenizer = load_models_from(args)
    if drafter is None:
        raise DflowError("eval-tau needs a drafter")
    stops = tuple(stop_token_ids(tokenizer))
    report = {"target": args.target or "bundled", "drafter": args.drafter, "relay": drafter.relay is not None
              and not args.no_relay, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
              "verify_width": args.verify_width, "suites": {}}
    with relay_off(drafter, args.no_relay):
        for suite in suite_names(args.suite):
            prompts = suite_prompts(tokenizer, suite, args.limit)
            result = measure_tau(target, drafter, prompts, suite, args.temperature, args.max_new_tokens, stops,
                                 args.batch, verify_width=args.verify_width, progress=True)
            report["suites"][suite] = entry = result.summary()
            if args.diagnostics:
                entry["diagnostics"] = relay_diagnostics(target, drafter, prompts, args.max_new_tokens, stops)
            if not args.json:
                _print_tau(suite, entry)
    if args.json:
        print(json.dumps(report))


def _print_tau(suite: str, e: dict) -> None:
    print(f"{suite}: tau {e['tau']:.3f} +- {e['tau_se']:.3f} over {e['prompts']} prompts ({e['rounds']} rounds)")
    print("  rounds emitting 1..B tokens: " + " ".join(map(str, e["histogram"])))
    print("  slot acceptance: " + " ".join(f"{x:.2f}" for x in e["position_acceptance"]))
    for key, value in e.get("diagnostics", {}).items():
        print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")


def cmd_init_random(args: argparse.Namespace) -> None:
    from dflow_rt.models.init_random import init_random

    target_dir, drafter_dir = init_random(args.out_dir, seed=args.seed)
    print(f"wrote {target_dir} and {drafter_dir} (random weights: the text they write is noise)")


def cmd_convert(args: argparse.Namespace) -> None:
    from dflow_rt.models.checkpoint import load_drafter, save_model
    from dflow_rt.models.drafter import with_relay

    parent = load_drafter(args.from_dflash, None)
    if parent.relay is not None:
        raise DflowError(f"{args.from_dflash}: already a DFlow drafter (it has 'dflow_config')")
    out = save_model(with_relay(parent, args.relay_hidden or parent.config.hidden_size, args.seed, args.relay_input),
                     args.out)
    print(f"wrote {out}: DFlow drafter with a zero-initialised relay (drafts exactly like its parent)")


def cmd_bench(args: argparse.Namespace) -> None:
    import random
    import tempfile

    if args.suite == "e2e":
        from dflow_rt.bench.e2e import run_e2e

        return run_e2e(args)
    if args.suite == "serve":
        from dflow_rt.bench.serve import run_serve_bench

        return run_serve_bench(args)

    from dflow_rt.bench.runtime import bench_runtime, format_table
    from dflow_rt.data.prompts import suite_prompts
    from dflow_rt.models.init_random import init_random

    n = max(args.batches)
    if args.random_models:
        args.target, args.drafter = init_random(tempfile.mkdtemp(prefix="dflow-bench-"), hidden=256)
        print(f"benchmarking random models written to {args.target.parent}")
    elif args.target is None:  # the bundled pair, on held-out HumanEval prompts
        args.drafter = args.drafter or "dflash"
    target, drafter, tokenizer = load_models_from(args, need_tokenizer=False)
    device = target.lm_head.weight.device.type
    if tokenizer is not None:
        prompt = suite_prompts(tokenizer, "code", 1, max_prompt_tokens=64)[0]
    else:
        prompt = [random.Random(0).randrange(target.config.vocab_size) for _ in range(32)]
    prompts = [prompt] * n  # one request in every row: every batch size decodes the same tokens per round
    modes = args.modes or (["eager", "compile"] + (["cudagraph"] if device == "cuda" else []))
    result = bench_runtime(target, drafter, prompts, modes, args.batches, args.rounds, args.verify_width)
    result |= {"target": str(args.target or "bundled"), "drafter": str(args.drafter), "device": device,
               "verify_width": args.verify_width}
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def parser() -> argparse.ArgumentParser:
    from dflow_rt.data.prompts import SUITES

    p = argparse.ArgumentParser(prog="dflow-rt", description="Block-diffusion speculative decoding runtime.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete a prompt with speculative decoding")
    model_args(g, "dflash, dflow (bundled for the default target and smollm2), a drafter directory, or none "
                   "for plain autoregressive decoding [dflash without --target, else none]")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 decodes greedily; above 0 samples, losslessly: the target's own distribution [0]")
    g.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest tokens; 0: all [0]")
    g.add_argument("--top-p", type=float, default=1.0, help="sample within the smallest set of this mass [1]")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed gives the same text, with or without a drafter [random]")
    g.add_argument("--block-size", type=int, default=None, help="default: the drafter's block size")
    g.add_argument("--verify-width", type=int, default=None, metavar="K",
                   help="verify only the first K drafted positions: fewer cost less on CPU, any K is lossless "
                        "[the tuned one, else per device: 4 on CPU, the block on CUDA]")
    g.add_argument("--ar-fallback", action=argparse.BooleanOptionalAction, default=None,
                   help="step the target alone while drafted rounds decode slower than that, as timed on the "
                        "running rounds; lossless either way [on on CPU unless --verify-width is given]")
    g.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="with the fallback, verify the text's own continuation where its last 3 tokens occurred "
                        "before, while that decodes faster; lossless either way [on]")
    g.add_argument("--keep-timings", action=argparse.BooleanOptionalAction, default=True,
                   help="with the fallback, start from what it learned in earlier runs of these models on this "
                        "machine, and keep what it learns (under $DFLOW_RT_CACHE/timings) [on]")
    g.add_argument("--mode", choices=MODES, default=None,
                   help="eager starts at once; compile (torch.compile: minutes the first time, seconds from its "
                        "disk cache after) decodes faster; cudagraph needs CUDA [the tuned one, else compile on "
                        "CPU and cudagraph on CUDA]")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights and activations; bfloat16 is faster on CPUs with BF16 instructions, and its greedy "
                        "output is the bf16 target's, not the float32 one's [float32 on CPU, bfloat16 on CUDA]")
    add_tuned_args(g)
    add_start_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--quiet-stats", action="store_true", help="print the statistics line to stderr")
    g.set_defaults(run=cmd_generate)
    e = sub.add_parser("eval-tau", help="acceptance length on held-out prompt suites")
    model_args(e, "dflash, dflow (bundled for the default target and smollm2) or a drafter directory [dflash]")
    e.add_argument("--suite", choices=[*SUITES, "public", "all"], default="all",
                   help="code: HumanEval; mt-bench: MT-Bench's first turns; champ: CHAMP's competition problems "
                        "(public: these three, written elsewhere); math, chat: held-out items of the project's own "
                        "generators [all]")
    e.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [0]")
    e.add_argument("--limit", type=int, default=None, help="first N prompts of each suite [all]")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--batch", type=int, default=8, help="prompts decoded together (tau does not depend on it)")
    e.add_argument("--verify-width", type=int, default=None,
                   help="verify only the first K - 1 drafted tokens, as a Runtime at that width [the whole block]")
    e.add_argument("--no-relay", action="store_true", help="switch a DFlow drafter's relay off (the ablation)")
    e.add_argument("--diagnostics", action="store_true",
                   help="also: target accuracy at rejected positions vs drafter slot 1, relay change rates")
    e.add_argument("--json", action="store_true", help="print one JSON object (with per-prompt tau)")
    e.set_defaults(run=cmd_eval_tau)
    r = sub.add_parser("init-random", help="write small random target and drafter directories")
    r.add_argument("out_dir")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(run=cmd_init_random)
    c = sub.add_parser("convert", help="turn a DFlash drafter into a DFlow drafter with a zero-init relay")
    c.add_argument("--from-dflash", required=True, metavar="DIR")
    c.add_argument("--out", required=True, metavar="DIR")
    c.add_argument("--relay-hidden", type=int, default=None, help="relay MLP width (default: hidden size)")
    c.add_argument("--relay-input", choices=("mask_embedding", "kv"), default="mask_embedding",
                   help="where the relay enters the draft pass: added to the mask embeddings, or as keys/values")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(run=cmd_convert)
    b = sub.add_parser("bench", help="benchmarks (figures for docs/RESULTS.md)")
    b.add_argument("--suite", choices=["runtime", "e2e", "serve"], default="runtime",
                   help="runtime: phases of a round per mode; e2e: ours against transformers, prompt lookup and "
                        "llama.cpp; serve: a load test of `dflow-rt serve` on loopback")
    b.add_argument("--target", default=None, help="[the bundled target, with the bundled DFlash drafter]")
    b.add_argument("--drafter", default=None, help="dflash, dflow (bundled) or a drafter directory")
    b.add_argument("--random-models", action="store_true", help="random models of the bundled size instead")
    b.add_argument("--modes", nargs="+", choices=MODES, default=None,
                   help="how the rounds run [eager compile, and cudagraph on CUDA]")
    b.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    b.add_argument("--rounds", type=int, default=30)
    b.add_argument("--verify-width", type=int, default=None, metavar="K",
                   help="runtime: the target verifies the first K drafted positions [the whole block]")
    b.add_argument("--threads", type=int, default=None, help="CPU threads [as for generate]")
    b.add_argument("--device", default=None)
    b.add_argument("--json", default=None, metavar="OUT")
    b.set_defaults(run=cmd_bench)
    from dflow_rt.bench.e2e import add_e2e_args

    add_e2e_args(b)
    from dflow_rt.bench.serve import add_serve_bench_args

    add_serve_bench_args(b)
    from dflow_rt.bench.soak import add_soak_parser
    from dflow_rt.commands.autotune import add_autotune_parser
    from dflow_rt.commands.serve import add_serve_parser
    from dflow_rt.commands.train import add_train_parser
    from dflow_rt.graphs.compile_cache import add_parser as add_compile_cache_parser
    from dflow_rt.models.fetch import add_fetch_parser

    add_autotune_parser(sub)
    add_compile_cache_parser(sub)
    add_fetch_parser(sub)
    add_serve_parser(sub)
    add_soak_parser(sub)
    add_train_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a background build runs again
    try:
        args.run(args)
    except DflowError as err:
        print(f"dflow-rt: error: {err}", file=sys.stderr)
        return 2
    return 0

