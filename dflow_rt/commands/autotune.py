"""`dflow-rt autotune`: tune the runtime's knobs for a target (and drafter) on this machine and write
them where `RuntimeConfig(tuned=True)` and `dflow-rt generate --tuned` find them."""

from __future__ import annotations

import argparse
import json

QUICK = {"prompts": 4, "max_new_tokens": 32, "repeats": 4, "budget": 180.0}
FULL = {"prompts": 4, "max_new_tokens": 96, "repeats": 5, "budget": None}


def cmd_autotune(args: argparse.Namespace) -> None:
    import os
    import platform
    import time

    import torch

    from dflow_rt.autotune.job import Measure, Tuner, default_axes
    from dflow_rt.data.prompts import suite_prompts
    from dflow_rt.engine.tuned import TunedConfig, device_name, entry_key, model_id, store
    from dflow_rt.models.bundled import drafter_dir, pick_device, set_threads, target_dir
    from dflow_rt.models.checkpoint import default_dtype, load_drafter, load_target
    from dflow_rt.tokenizer import load_tokenizer

    device = torch.device(pick_device(args.device))
    settings = {k: getattr(args, k) if getattr(args, k) is not None else v
                for k, v in (QUICK if args.quick else FULL).items()}
    target_path = target_dir(args.target)
    spec = args.drafter or ("dflash" if args.target is None else "none")
    drafter_path = None if spec == "none" else drafter_dir(spec, args.target)
    models: dict[str, tuple] = {}

    def load(dtype: str) -> tuple:
        if dtype not in models:
            target = load_target(target_path, dtype=getattr(torch, dtype), device=device)
            models[dtype] = (target, load_drafter(drafter_path, target) if drafter_path else None)
        return models[dtype]

    dtype = str(default_dtype(device)).removeprefix("torch.")
    target, drafter = load(dtype)
    set_threads(None, target)  # the CLI's own default, the baseline to beat
    default = TunedConfig(dtype, torch.get_num_threads())
    block = drafter.block_size if drafter is not None else 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    prompts = suite_prompts(load_tokenizer(target_path), "code", settings["prompts"], max_prompt_tokens=128)
    name = device_name(device)
    if device.type == "cuda":
        print("autotune: the Triton kernels expose no launch configs (block sizes are fixed): tuning which ops "
              "they serve")
    measure = Measure(settings["max_new_tokens"], settings["repeats"],
                      max(512, 128 + settings["max_new_tokens"] + 2 * block), settings["budget"])
    axes = default_axes(args.quick, device.type == "cuda", default, block, cores)
    tuner = Tuner(load, prompts, args.batches, default, axes, measure)
    result = tuner.search()
    entry = {"target": model_id(target_path), "drafter": model_id(drafter_path), "dtype": result.tuned.dtype,
             "knobs": {result.tuned.dtype: result.record(block)}, "default": result.default.knobs(),
             "kept_default": result.kept_default, "date": time.strftime("%Y-%m-%d %H:%M"),
             "torch": torch.__version__, "machine": {"device": name, "platform": platform.platform(),
                                                      "python": platform.python_version()},
             "search": "quick" if args.quick else "full", "batches": sorted(args.batches), **settings,
             "seconds": result.seconds, "trials": result.trials}
    path = store(entry, entry_key(target_path, drafter_path), name, args.out)
    if args.json:
        print(json.dumps({"path": str(path), **entry}))
        return
    knobs = entry["knobs"][result.tuned.dtype]
    print(f"{name}: {entry['target']} + {entry['drafter']}, {'default kept' if result.kept_default else 'tuned'}: "
          f"dtype {result.tuned.dtype}, mode {knobs['mode']}, threads {knobs['threads']}, "
          f"length step {knobs['length_step'] or 'default'}")
    print("| batch | verify width | default tokens/s | tuned tokens/s | speedup | noise |\n|---|---|---|---|---|---|")
    for n, b in knobs["buckets"].items():
        print(f"| {n} | {b['verify_width'] or '-'} | {b['default_tokens_per_s']:.1f} | {b['tuned_tokens_per_s']:.1f} "
              f"| {b['speedup']:.2f}x | {b['noise']:.3f} |")
    print(f"wrote {path} ({result.seconds:.0f} s)")


def add_autotune_parser(subparsers) -> argparse.ArgumentParser:
    """Register `autotune` on the main CLI."""
    p = subparsers.add_parser("autotune", help="measure the runtime's knobs on this machine; keep the faster "
                                               "lossless ones for RuntimeConfig(tuned=True)")
    p.add_argument("--quick", action="store_true",
                   help="screen every knob in eager mode, then try compiling once (minutes); default: the full "
                        "search, every knob measured in the winning mode (a compile per candidate)")
    p.add_argument("--target", default=None, help="a target directory, or smollm2 (fetched) [the bundled target]")
    p.add_argument("--drafter", default=None,
                   help="dflash, dflow (bundled), a drafter directory, or none [dflash with the bundled target, "
                        "else none]")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory of the tuned files [${DFLOW_RT_CONFIG:-${XDG_CONFIG_HOME:-~/.config}/dflow-rt}"
                        "/tuned], one <device>.json per device")
    p.add_argument("--json", action="store_true", help="print the written entry as one JSON object")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4], help="batch buckets to tune [1 4]")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--prompts", type=int, default=None, help="HumanEval prompts decoded per measurement [4]")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per prompt [32 quick, 96 full]")
    p.add_argument("--repeats", type=int, default=None, help="paired decodes per comparison [4 quick, 5 full]")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds after which only the last axis still runs [180 quick, none full]")
    p.set_defaults(run=cmd_autotune)
    return p
