"""How commands turn their flags into models and Runtime settings: the models by name or directory,
the autotune knobs, the per-device defaults, and the flags that win over both. Shared by `dflow-rt
generate`, `eval-tau`, `bench` and `serve`; it imports no command."""

from __future__ import annotations

import argparse
import sys


def model_args(p: argparse.ArgumentParser, drafter_help: str) -> None:
    """--target, --drafter, --device, --threads."""
    p.add_argument("--target", default=None,
                   help="HF model directory with its tokenizer or a fetched model's name: smollm2 [the bundled target]")
    p.add_argument("--drafter", default=None, help=drafter_help)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads [1 for targets under 50M parameters, else all cores]")


def load_models_from(args: argparse.Namespace, need_tokenizer: bool = True, dtype: str | None = None):
    """`load_models` from --target/--drafter/--device/--threads: how every command loads models."""
    from dflow_rt.models.bundled import load_models

    return load_models(args.target, args.drafter, args.device, args.threads, need_tokenizer, dtype)


def runtime_config(args: argparse.Namespace, tuned, block: int, **sizes):
    """The Runtime's settings from the command line: a flag given wins, then the autotune knobs
    (`tuned`, already looked up with the dtype in mind), then the Runtime's per-device defaults
    (`tuned.resolve`)."""
    from dflow_rt.config import AUTO, RuntimeConfig
    from dflow_rt.engine.tuned import apply

    config = RuntimeConfig(**sizes, block_size=args.block_size, mode=args.mode or AUTO,
                           verify_width=AUTO if args.verify_width is None else args.verify_width, tuned=False,
                           ar_fallback=AUTO if getattr(args, "ar_fallback", None) is None else args.ar_fallback,
                           lookup=getattr(args, "lookup", True), keep_timings=getattr(args, "keep_timings", True))
    return apply(config, tuned, block)


def tuned_knobs(args: argparse.Namespace):
    """What `dflow-rt autotune` chose for --target/--drafter on this device (dtype and threads included,
    which apply before the models load), or None (--no-tuned, or no entry); one line on stderr when
    it applies (it changes the speed), and when --tuned asked for knobs that are not there."""
    from dflow_rt.engine.tuned import load_tuned, tuned_dir
    from dflow_rt.models.bundled import drafter_dir, pick_device, target_dir

    if getattr(args, "no_tuned", False):
        return None
    device = pick_device(args.device)
    spec = None if args.drafter in (None, "none") else drafter_dir(args.drafter, args.target)
    tuned = load_tuned(target_dir(args.target), spec, device, args.dtype)  # --dtype: that dtype's knobs
    if tuned is None and args.tuned:
        print(f"--tuned: no usable knobs for these models on this device in {tuned_dir()}: runtime defaults "
              f"(`dflow-rt autotune` writes them)", file=sys.stderr)
    elif tuned is not None:
        print(f"autotune: {tuned.path}: dtype {tuned.dtype}, mode {tuned.mode}, threads {tuned.threads}, "
              f"verify width {dict(tuned.verify_width) or 'the block'} (--no-tuned: the defaults)", file=sys.stderr)
    return tuned


def add_tuned_args(p: argparse.ArgumentParser) -> None:
    """--tuned / --no-tuned."""
    tuned = p.add_mutually_exclusive_group()
    tuned.add_argument("--tuned", action="store_true",
                       help="say so when `dflow-rt autotune` wrote no knobs for these models here (they apply "
                            "without the flag: dtype, threads, mode, verify widths; flags given still win)")
    tuned.add_argument("--no-tuned", action="store_true", help="ignore the autotune knobs: the built-in defaults")
