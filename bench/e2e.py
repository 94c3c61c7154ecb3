"""`dflow-rt bench --suite e2e`: our decoders against transformers, same prompts and weights, one run.

Per target: transformers `generate()` greedy and with prompt lookup (float32, batch 1), our
reference loop with each drafter, and the Runtime autoregressively and with each drafter for
every mode, batch size and dtype. The drafted Runtime rows verify the k that decoded fastest
in a quick sweep (eager, float32, two prompts). Every method is built (and compiled) before
timing starts and warmed up once; then the methods take turns per group of prompts, the order
rotating, so that load drift on a shared machine reaches all alike, and the figures are medians
over calls. Each output is compared with our autoregressive greedy output of the same dtype: at
T = 0 every float32 method must reproduce it exactly, and a run where one does not fails. In
bfloat16 every other kernel or shape (a batch of 4, compiled kernels, k positions verified in
one pass) rounds differently, so near-tie argmaxes flip, in our own AR too (seen at a float32
logit gap of 0.008 on the bundled target); bf16 mismatches are marked but do not fail the run.
On CPU the run uses one thread unless --threads says otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from dflow_rt.bench.decoders import Run, Runner, hf_runner, reference_runner, runtime_runner
from dflow_rt.bench.report import (
    best_width,
    bf16_matmul,
    bytes_per_token,
    format_table,
    format_widths,
    label,
    machine,
    read_bandwidth,
)
from dflow_rt.config import DTYPES, RuntimeConfig
from dflow_rt.errors import CheckpointError, DflowError, InputError
from dflow_rt.models import exact_codes
from dflow_rt.models.bundled import pick_device

BUNDLED_PAIR = ("dflash", "dflow")  # the drafters bundled for a target, benchmarked by default
WARMUP_TOKENS = 8


@dataclass
class Method:
    """One row of the table: a decoder in one configuration, and what each of its calls produced."""

    name: str  # hf_generate, hf_prompt_lookup, reference, ar, or the drafter's label
    mode: str
    batch: int
    dtype: str
    run: Runner = field(repr=False)
    drafter: str | None = None
    k: int | None = None  # verify width of a drafted method
    calls: list[tuple[list[int], Run]] = field(default_factory=list, repr=False)


def add_e2e_args(p: argparse.ArgumentParser) -> None:
    """Flags of `bench --suite e2e` beyond the bench's own (--target, --modes, --batches, --json ...)."""
    p.add_argument("--targets", nargs="+", default=None, metavar="TARGET",
                   help="e2e: bundled, smollm2 (fetched) or directories [--target, else bundled]")
    p.add_argument("--drafters", nargs="+", default=None, metavar="DRAFTER",
                   help="e2e: drafter names or directories, tried on every target [--drafter, else dflash dflow "
                        "for bundled]")
    p.add_argument("--prompts", type=int, default=8, help="e2e: first N prompts of --prompt-suite [8]")
    p.add_argument("--prompt-suite", choices=("code", "math", "chat"), default="code",
                   help="e2e: the held-out suite the prompts come from (code: HumanEval; each drafter's tau "
                        "differs by suite) [code]")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float32"],
                   help="e2e: bfloat16 (skipped with a note where the device has no bf16 matmul) about doubles "
                        "the run: 16-25 instead of ~11 min for bundled + smollm2 on a busy 2-core EPYC [float32]")
    p.add_argument("--verify-widths", nargs="+", type=int, default=[4, 8, 16], metavar="K",
                   help="e2e: verify widths swept per drafter and batch; the fastest is used [4 8 16]")
    p.add_argument("--every-width", action="store_true",
                   help="e2e: no sweep: each drafted row at every --verify-widths k (a default's width is then "
                   "timed compiled even where another k would win the eager sweep)")
    p.add_argument("--prompt-lookup", type=int, default=10, help="e2e: transformers' prompt_lookup_num_tokens")
    p.add_argument("--prompt-ids", default=None, metavar="FILE",
                   help="e2e: JSON list of token-id lists, instead of --prompt-suite (targets without a tokenizer)")
    p.add_argument("--compiler", default="inductor", help="e2e: torch.compile's backend for `compile` rows")
    p.add_argument("--plots", default=None, metavar="DIR", help="e2e: write PNG plots there (needs matplotlib)")
    p.add_argument("--freeze", action="store_true",
                   help="e2e: compiled rows with frozen weights (on CPU with inductor's C++ GEMM templates; "
                   "compiled at every start)")
    p.add_argument("--ar-fallback", action="store_true",
                   help="e2e: each drafted row also with the fallback to plain target steps (RuntimeConfig."
                   "ar_fallback)")
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="e2e: skip the llama.cpp rows (run when llama-cpp-python is installed: the llamacpp extra)")


def run_e2e(args: argparse.Namespace) -> dict:
    """Benchmark every target, print the table, write --json and --plots; fail if any output differs."""
    device = torch.device(pick_device(args.device))
    dtypes, notes = list(args.dtypes), []
    if "bfloat16" in dtypes and not bf16_matmul(device):
        dtypes.remove("bfloat16")
        notes.append(f"bfloat16 skipped: {device.type} reports no bf16 matmul")
    modes = args.modes or ["eager", "compile"] + (["cudagraph"] if device.type == "cuda" else [])
    # one thread on CPU unless --threads: with another job on the second core, two threads
    # decode SmolLM2 about 3x slower here, as every op waits for the busier core
    torch.set_num_threads(args.threads or (1 if device.type == "cpu" else torch.get_num_threads()))
    # every compiled Runtime adds graphs to the one compiled round function's cache
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    settings = {"prompts": args.prompts, "prompt_suite": "ids" if args.prompt_ids else args.prompt_suite,
                "max_new_tokens": args.max_new_tokens, "modes": modes,
                "batches": args.batches, "dtypes": dtypes, "verify_widths": args.verify_widths,
                "prompt_lookup": args.prompt_lookup, "compiler": args.compiler, "freeze": args.freeze,
                "ar_fallback": args.ar_fallback, "every_width": args.every_width,
                "threads": torch.get_num_threads(), "timing": "medians over calls; decode tokens/s = tokens after "
                "the first emission / time after it; speedup = ratio of those medians"}
    result = {"suite": "e2e", "machine": machine(device), "settings": settings, "notes": notes, "rows": [],
              "targets": {}}
    for spec in args.targets or [args.target or "bundled"]:
        rows, info = bench_target(spec, args, device, modes, dtypes, notes)
        result["rows"] += rows
        result["targets"][spec] = info
        gc.collect()  # the last target's models and Runtimes, before the next target loads
    differ = [r for r in result["rows"] if r["identical"] < 1.0]
    ours = [r for r in differ if not r["method"].startswith("llama_cpp")]
    result["failures"] = [f"{r['target']}: {label(r)}" for r in ours if r["dtype"] == "float32"]
    result["bf16_mismatches"] = [f"{r['target']}: {label(r)}" for r in ours if r["dtype"] != "float32"]
    if len(ours) < len(differ):
        notes.append("llama.cpp rows are compared, not required to match: its float32 kernels sum in another "
                     "order, so near-tie argmaxes can flip")
    if result["bf16_mismatches"]:
        notes.append("!! marks bf16 rows whose outputs differ from bf16 AR greedy (eager, first batch size): in "
                     "bf16 any other kernel or shape (batch, compiled kernels, k positions per pass) rounds "
                     "differently and flips near-tie argmaxes, our own AR included; float32 rows are exact")
    print(format_table(result))
    print(format_widths(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plots:
        from dflow_rt.bench.plots import write_plots

        stem = Path(args.json).stem if args.json else "bench_e2e"
        for path in write_plots(result, Path(args.plots), stem):
            print(f"wrote {path}")
    for r in differ:
        print(f"!!! {r['target']}: {label(r)}: {100 * r['identical']:.1f} % identical to AR greedy", file=sys.stderr)
    if result["failures"]:
        raise DflowError(f"NOT LOSSLESS: {len(result['failures'])} float32 rows differ from AR greedy at T = 0")
    return result


def bench_target(spec: str, args, device: torch.device, modes: list[str], dtypes: list[str],
                 notes: list[str]) -> tuple[list[dict], dict]:
    """Every method on one target: build all, sweep k, warm up, measure interleaved, summarise."""
    from dflow_rt.models.bundled import bundled_targets, target_dir
    from dflow_rt.models.checkpoint import load_target

    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 1)

    path = target_dir(None if spec == "bundled" else spec)
    targets = {d: load_target(path, dtype=getattr(torch, d), device=device) for d in dtypes}
    prompts, stops = load_prompts(path, args)
    specs = args.drafters or ([args.drafter] if args.drafter else
                              BUNDLED_PAIR if spec == "bundled" or spec in bundled_targets() else [])
    drafters = load_drafters(spec, specs, targets, notes)
    block = max([d.block_size for d in drafters[dtypes[0]].values()] or [1])
    max_len = max(map(len, prompts)) + args.max_new_tokens + 2 * block
    methods: list[Method] = []
    if "float32" in dtypes:
        hf = load_hf(path, device)
        methods += [Method("hf_generate", "eager", 1, "float32", hf_runner(hf, stops)),
                    Method("hf_prompt_lookup", "eager", 1, "float32", hf_runner(hf, stops, args.prompt_lookup))]
        methods += llama_cpp_methods(path, args, stops, max_len, notes)
    else:
        notes.append(f"{spec}: transformers and llama.cpp rows run in float32 only, which --dtypes leaves out")
    seconds = {"load": lap()}
    sweep_dtype = "float32" if "float32" in dtypes else dtypes[0]
    widths = sweep_widths(spec, targets[sweep_dtype], drafters[sweep_dtype], args, prompts, max_len, stops)
    seconds["sweep"] = lap()
    builds = [(d, b, n) for d in dtypes for b in modes for n in sorted(args.batches)]
    for dtype, mode, batch in tqdm(builds, desc=f"{spec}: building", leave=False):
        target = targets[dtype]
        base = RuntimeConfig(max_batch=batch, max_len=max_len, mode=mode, compiler=args.compiler, freeze=args.freeze,
                             verify_width=None, ar_fallback=False)
        methods.append(Method("ar", mode, batch, dtype, runtime_runner(target, None, base, stops)))
        for name, drafter in drafters.get(dtype, {}).items():
            for k in sorted(widths[name][batch]) if args.every_width else [best_width(widths[name][batch])]:
                config = replace(base, verify_width=k)
                methods.append(Method(name, mode, batch, dtype, runtime_runner(target, drafter, config, stops),
                                      name, k))
                if args.ar_fallback:
                    methods.append(Method(f"{name}+fallback", mode, batch, dtype, runtime_runner(
                        target, drafter, replace(config, ar_fallback=True), stops), name, k))
    for dtype in dtypes:
        for name, drafter in drafters.get(dtype, {}).items():
            methods.append(Method("reference", "eager", 1, dtype, reference_runner(targets[dtype], drafter, stops),
                                  name, drafter.block_size))
    seconds["build"] = lap()
    measure(methods, prompts, args.max_new_tokens, max(args.batches), f"{spec}: decoding")
    seconds["decode"] = lap()
    gbps, weights = read_bandwidth(device), {d: bytes_per_token(t) for d, t in targets.items()}
    bound = {d: gbps * 1e9 / b for d, b in weights.items()}
    plain = {d: gbps * 1e9 / bytes_per_token(t, codes=False) for d, t in targets.items()}  # the peers read float32
    rows = summarize(methods, spec)
    for r in rows:
        peer = r["method"].startswith(("hf_", "llama_cpp"))
        counted = r["batch"] == 1 and r["method"] != "llama_cpp_q4_1"  # Q4_1 reads other bytes than either bound
        r["bound_share"] = r["tokens_per_s"] * r["batch"] / (plain if peer else bound)[r["dtype"]] if counted else None
    notes.append(f"{spec}: read bandwidth {gbps:.1f} GB/s at {torch.get_num_threads()} thread(s) (sums over 512 MB); "
                 + ", ".join(f"{d} decode reads {weights[d] / 1e6:.0f} MB a token{coded(targets[d])}: bound "
                             f"{bound[d]:.1f} tokens/s at batch 1" for d in dtypes))
    return rows, {
        "path": str(path), "prompt_tokens": [len(p) for p in prompts], "read_gbps": gbps,
        "bytes_per_token": weights, "bound_tokens_per_s": bound, "float32_bound_tokens_per_s": plain,
        "stop_token_ids": list(stops), "verify_width_sweep": widths, "seconds": seconds}


def coded(target) -> str:
    """How the note names a target whose products stream exact codes (`dflow_rt.models.exact_codes`)."""
    kinds = exact_codes.kinds(target)
    n = len(kinds) - kinds.count("float32")
    return f" ({n} of {len(kinds)} weights as exact codes)" if n else ""


def llama_cpp_methods(path: Path, args, stops: list[int], max_len: int, notes: list[str]) -> list[Method]:
    """llama.cpp greedy and with prompt lookup on the same weights as F32 GGUF, or a note why not."""
    from dflow_rt.bench import llamacpp

    version = llamacpp.available()
    if args.no_llama_cpp or version is None or not (path / "tokenizer.json").exists():
        if version is None:
            notes.append("llama.cpp rows skipped: llama-cpp-python is not installed (pip install 'dflow-rt[llamacpp]')")
        elif not args.no_llama_cpp:
            notes.append(f"llama.cpp rows skipped: {path} has no tokenizer.json for llama.cpp's converter")
        return []
    try:
        gguf = llamacpp.gguf_file(path, version)
    except (InputError, OSError, subprocess.CalledProcessError) as err:
        notes.append(f"llama.cpp rows skipped: {err}")
        return []
    threads = torch.get_num_threads()
    notes.append(f"llama.cpp: llama-cpp-python {version}, {gguf.name}, {threads} thread(s)")
    n_ctx = max_len + args.prompt_lookup  # its lookup drafts reach past the last token (a block 4 leaves less slack)
    methods = [Method(name, "llama.cpp", 1, "float32", llamacpp.llama_cpp_runner(gguf, stops, threads, n_ctx, lookup))
               for name, lookup in (("llama_cpp", None), ("llama_cpp_prompt_lookup", args.prompt_lookup))]
    try:  # compared against float32 greedy like the others: it rounds activations, so it may differ
        q4 = llamacpp.q4_1_file(gguf)
        notes.append(f"llama_cpp_q4_1: {q4.name}, llama.cpp's Q4_1 (embedding Q8_0) of the same weights")
        methods.append(Method("llama_cpp_q4_1", "llama.cpp", 1, "float32",
                              llamacpp.llama_cpp_runner(q4, stops, threads, n_ctx)))
    except (InputError, OSError) as err:
        notes.append(f"llama_cpp_q4_1 row skipped: {err}")
    return methods


def load_prompts(path: Path, args) -> tuple[list[list[int]], list[int]]:
    """(prompts, stop ids): --prompt-ids as given, else the first prompts of --prompt-suite, tokenized."""
    if args.prompt_ids:
        return json.loads(Path(args.prompt_ids).read_text())[:args.prompts], []
    if not (path / "tokenizer.json").exists():
        raise InputError(f"{path} has no tokenizer: pass token-id prompts with --prompt-ids FILE")
    from dflow_rt.data.prompts import suite_prompts
    from dflow_rt.tokenizer import load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(path)
    return suite_prompts(tokenizer, args.prompt_suite, args.prompts), stop_token_ids(tokenizer)


def load_drafters(spec: str, specs, targets: dict, notes: list[str]) -> dict[str, dict]:
    """{dtype: {label: drafter}} of the drafters that exist and fit the target; a note for each other."""
    from dflow_rt.models.bundled import BUNDLED_DRAFTERS, drafter_dir
    from dflow_rt.models.checkpoint import load_drafter

    out: dict[str, dict] = {d: {} for d in targets}
    for s in specs:
        name = s if s in BUNDLED_DRAFTERS else Path(s).name
        try:
            for dtype, target in targets.items():
                out[dtype][name] = load_drafter(drafter_dir(s, None if spec == "bundled" else spec), target)
        except (CheckpointError, InputError) as err:
            notes.append(f"{spec}: drafter {s} skipped ({err})")
    if not specs:
        notes.append(f"{spec}: no drafters given (--drafters DIR DIR): reference and drafted rows skipped")
    return out


def load_hf(path: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def sweep_widths(spec: str, target, drafters: dict, args, prompts, max_len: int,
                 stops) -> dict[str, dict[int, dict[int, float | None]]]:
    """{drafter: {batch: {k: decode tokens/s}}} of every verify width on the first two prompts (eager,
    float32 when measured, every k interleaved); the fastest k is the one the table's rows use. Eager
    rounds are quick to build; they are only a guide for the compiled ones, whose fixed cost per round
    is smaller. A single k, or every k with --every-width, is not timed (None)."""
    speeds: dict[str, dict[int, dict[int, float | None]]] = {}
    for name, drafter in drafters.items():
        ks = sorted({min(k, drafter.block_size) for k in args.verify_widths})
        speeds[name] = {}
        for batch in sorted(args.batches):
            if len(ks) == 1 or args.every_width:
                speeds[name][batch] = dict.fromkeys(ks)
                continue
            rows = [prompts[i % min(2, len(prompts))] for i in range(max(4, 2 * batch))]
            methods = [Method(name, "eager", batch, "float32", runtime_runner(target, drafter, RuntimeConfig(
                max_batch=batch, max_len=max_len, mode="eager", verify_width=k), stops), name, k) for k in ks]
            measure(methods, rows, args.max_new_tokens, batch, f"{spec}: {name} batch {batch}: k in {ks}")
            speeds[name][batch] = {m.k: round(median_tokens_per_s(m), 2) for m in methods}
    return speeds


def measure(methods: list[Method], prompts: list[list[int]], max_new: int, group: int, desc: str) -> None:
    """Warm every method up, then let them take turns per group of prompts, the order rotating;
    a method of batch b decodes a group b prompts at a time, the others one at a time."""
    for m in methods:
        m.run([prompts[i % len(prompts)] for i in range(m.batch)], min(WARMUP_TOKENS, max_new))
    groups = [list(range(i, min(i + group, len(prompts)))) for i in range(0, len(prompts), group)]
    with tqdm(total=len(groups) * len(methods), desc=desc, leave=False) as bar:
        for g, idx in enumerate(groups):
            shift = g % len(methods)
            for m in methods[shift:] + methods[:shift]:
                for j in range(0, len(idx), m.batch):
                    chunk = idx[j:j + m.batch]
                    m.calls.append((chunk, m.run([prompts[i] for i in chunk], max_new)))
                bar.update()


def median_tokens_per_s(m: Method) -> float:
    return statistics.median([r.decode_tokens / r.decode_s for _, r in m.calls if r.decode_s > 0] or [0.0])


def summarize(methods: list[Method], spec: str) -> list[dict]:
    """One row per method; identity against the first AR method of its dtype, speedups as ratios of
    the medians against transformers generate and against our AR at the same mode, batch, dtype."""
    ars = [m for m in methods if m.name == "ar"]
    reference = {m.dtype: m for m in reversed(ars)}  # the first AR method of each dtype
    rows = []
    for m in methods:
        per_prompt = {i: (out, acc) for chunk, r in m.calls for i, out, acc in zip(chunk, r.outputs, r.acceptance,
                                                                                       strict=True)}
        truth = {i: out for chunk, r in reference[m.dtype].calls for i, out in zip(chunk, r.outputs, strict=True)}
        rounds = [a for _, acc in per_prompt.values() for a in acc]
        rows.append({"target": spec, "method": m.name, "drafter": m.drafter, "mode": m.mode, "batch": m.batch,
                     "dtype": m.dtype, "k": m.k, "prompts": len(per_prompt), "calls": len(m.calls),
                     "tau": statistics.mean([statistics.mean(acc) for _, acc in per_prompt.values() if acc] or [1]),
                     "tokens_per_s": median_tokens_per_s(m),
                     "ttft_ms": 1e3 * statistics.median(r.ttft_s for _, r in m.calls),
                     "acceptance_histogram": [rounds.count(a) for a in range(1, max(rounds, default=1) + 1)],
                     "identical": statistics.mean(out == truth[i] for i, (out, _) in per_prompt.items()),
                     "tokens": sum(len(out) for out, _ in per_prompt.values())})
    hf = next((r for r in rows if r["method"] == "hf_generate"), None)
    for r, m in zip(rows, methods, strict=True):
        ar = next((a for a in ars if (a.mode, a.batch, a.dtype) == (m.mode, m.batch, m.dtype)),
                  reference[m.dtype])
        r["speedup_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"] if hf else None
        r["speedup_vs_ar"] = r["tokens_per_s"] / rows[methods.index(ar)]["tokens_per_s"]
        r["ar_baseline"] = {"mode": ar.mode, "batch": ar.batch, "dtype": ar.dtype}
    return rows
