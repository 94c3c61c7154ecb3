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


def load_decoding_models(args: argparse.Namespace):
    """(target, drafter or None, tokenizer) for a command that decodes (generate, serve): the bundled
    DFlash drafter by default where the package ships one for the target (`--drafter none`: the
    target alone), and the autotune file's dtype and threads where the flags leave them open. On a
    CPU whose C++ kernels are not built yet, the answer does not wait for them either (`cpu_ops.defer`):
    the background build of the compiled rounds makes them."""
    from dflow_rt.kernels.cpu import ops as cpu_ops
    from dflow_rt.models.bundled import bundled_targets, pick_device

    wait = getattr(args, "compile_wait", False) or getattr(args, "build_rounds", False)
    if not wait and args.mode != "eager" and pick_device(args.device) == "cpu":
        cpu_ops.defer()  # before the models load: they load as float32, coded once the kernels are on
    if args.drafter is None and (args.target is None or args.target in bundled_targets()):
        args.drafter = "dflash"  # the default drafter of every bundled pair (docs/RESULTS.md)
    tuned = tuned_knobs(args)
    if tuned is not None and args.threads is None:
        args.threads = tuned.threads
    return load_models_from(args, dtype=args.dtype or (tuned.dtype if tuned else None))


def runtime_config(args: argparse.Namespace, **sizes):
    """The Runtime's settings from the command line: the flags given, explicit; the rest "auto", which
    the Runtime resolves (`engine.settings.resolve_config`: the autotune knobs unless --no-tuned, then
    the per-device defaults). Compiled rounds not yet on disk do not hold up the answer (`eager_start`)
    unless --compile-wait, or this process is the one building them (`--build-rounds`)."""
    from dflow_rt.config import AUTO, RuntimeConfig

    wait = getattr(args, "compile_wait", False) or getattr(args, "build_rounds", False)
    return RuntimeConfig(**sizes, block_size=args.block_size, mode=args.mode or AUTO, eager_start=not wait,
                         verify_width=AUTO if args.verify_width is None else args.verify_width,
                         tuned=not getattr(args, "no_tuned", False),
                         ar_fallback=AUTO if getattr(args, "ar_fallback", None) is None else args.ar_fallback,
                         lookup=getattr(args, "lookup", True), keep_timings=getattr(args, "keep_timings", True))


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


def add_start_args(p: argparse.ArgumentParser) -> None:
    """--compile-wait, and the hidden --build-rounds of the background build (`build_in_background`)."""
    p.add_argument("--compile-wait", action="store_true",
                   help="where no compiled rounds are on disk yet, compile them before the first answer (minutes) "
                        "instead of answering from eager rounds while a background process builds them")
    p.add_argument("--build-rounds", action="store_true", help=argparse.SUPPRESS)


KERNELS_PENDING = " over torch's ops (the C++ kernels are not built on this machine yet)"


def build_in_background(argv: list[str], meanwhile: str) -> None:
    """Run this command again as `--build-rounds`, detached: it builds the C++ kernels where they are
    not built yet and the compiled rounds into the disk cache and exits, so that later starts (and a
    running server, between requests) use them. One line on stderr says so, with the build's pid and log."""
    import os
    import subprocess

    from dflow_rt.paths import cache_root

    log = cache_root() / "compiled" / f"build-{os.getpid()}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dflow_rt", *argv, "--build-rounds"], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"dflow-rt: no compiled rounds on disk for these models and settings yet: {meanwhile}; building them in "
          f"the background for later runs (pid {proc.pid}, log {log}; --compile-wait: compile first)",
          file=sys.stderr, flush=True)


def add_tuned_args(p: argparse.ArgumentParser) -> None:
    """--tuned / --no-tuned."""
    tuned = p.add_mutually_exclusive_group()
    tuned.add_argument("--tuned", action="store_true",
                       help="say so when `dflow-rt autotune` wrote no knobs for these models here (they apply "
                            "without the flag: dtype, threads, mode, verify widths; flags given still win)")
    tuned.add_argument("--no-tuned", action="store_true", help="ignore the autotune knobs: the built-in defaults")
