"""`dflow-rt serve`: load the models as `generate` does, build one Runtime and serve it over HTTP.

SIGTERM (or Ctrl-C) stops taking requests, lets running ones finish for `--shutdown-grace`
seconds, ends the rest (their clients get an error), and exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from dflow_rt.commands.common import (
    KERNELS_PENDING,
    add_start_args,
    add_tuned_args,
    build_in_background,
    load_decoding_models,
    model_args,
    runtime_config,
)
from dflow_rt.config import DTYPES, MODES
from dflow_rt.errors import DflowError

DEFAULT_MAX_LEN = 2048  # the KV cache is max_batch x max_len, preallocated: the model's own limit if smaller


def add_serve_parser(sub: argparse._SubParsersAction) -> None:

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)")
    model_args(s, "dflash, dflow (bundled), a drafter directory, or none [dflash without --target, else none]")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=16, help="rows decoded together [16]")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a row; beyond it the server answers 429 [64]")
    s.add_argument("--max-prefill-tokens", type=int, default=128,
                   help="prompt tokens a step prefills at most while other requests decode (RuntimeConfig."
                        "prefill_chunk): longer prompts are prefilled in chunks over several steps; lower keeps "
                        "the running streams' inter-token latency flat, higher starts new requests sooner [128]")
    s.add_argument("--max-len", type=int, default=None,
                   help=f"context per row, prompt + answer + one block [the model's, at most {DEFAULT_MAX_LEN}]")
    s.add_argument("--block-size", type=int, default=None, help="default: the drafter's block size")
    s.add_argument("--verify-width", type=int, default=None, metavar="K", help="as for generate")
    s.add_argument("--ar-fallback", action=argparse.BooleanOptionalAction, default=None, help="as for generate")
    s.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True, help="as for generate [on]")
    s.add_argument("--keep-timings", action=argparse.BooleanOptionalAction, default=True, help="as for generate [on]")
    s.add_argument("--mode", choices=MODES, default=None, help="as for generate [the tuned one, else per device]")
    s.add_argument("--dtype", choices=DTYPES, default=None, help="as for generate")
    add_tuned_args(s)
    add_start_args(s)
    s.add_argument("--api-key", default=None,
                   help="every route but /health then needs `Authorization: Bearer KEY` (401 otherwise); also from "
                        "the environment variable DFLOW_RT_API_KEY [none: anyone who reaches the port is served]")
    s.add_argument("--served-model-name", default=None,
                   help="the `model` clients must send [the --target name or directory name, else bundled]")
    s.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests get to finish after SIGTERM [10]")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.set_defaults(run=cmd_serve)


def build_engine(args: argparse.Namespace):
    """(engine, model name): the models, Runtime and engine that `args` describe (generate's rules
    for target, drafter, tuned knobs, mode, threads and dtype)."""
    from dflow_rt.engine.runtime import Runtime
    from dflow_rt.serve.engine import Engine
    from dflow_rt.tokenizer import stop_token_ids

    target, drafter, tokenizer = load_decoding_models(args)
    max_len = args.max_len or min(target.config.max_position_embeddings, DEFAULT_MAX_LEN)
    config = runtime_config(args, max_batch=args.max_batch, max_len=max_len, prefill_chunk=args.max_prefill_tokens)
    engine = Engine(Runtime(target, drafter, config), tokenizer, args.max_queue, stop_token_ids(tokenizer))
    name = args.served_model_name or (Path(args.target).name if args.target else "bundled")
    return engine, name


def api_key_of(args: argparse.Namespace) -> str | None:
    """--api-key, else $DFLOW_RT_API_KEY (kept out of the process list), else None: no key."""
    return args.api_key or os.environ.get("DFLOW_RT_API_KEY") or None


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        import uvicorn

        from dflow_rt.serve.app import create_app
    except ImportError as err:
        raise DflowError(f"serve needs the serve extra: pip install 'dflow-rt[serve]' ({err})") from None
    if args.max_queue < 0 or args.shutdown_grace < 0 or args.max_prefill_tokens < 1:
        raise DflowError("--max-queue and --shutdown-grace must be >= 0, --max-prefill-tokens >= 1")
    engine, name = build_engine(args)
    if args.build_rounds:
        return  # built and on disk: the server that started this process switches to them
    if engine.rt.compile_pending:
        build_in_background(args.argv, "serving from eager rounds" + KERNELS_PENDING * engine.rt.kernels_pending
                            + " meanwhile (the server switches between requests)")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # a signal handler: drain() only sets an attribute
            engine.drain(args.shutdown_grace)
            super().handle_exit(sig, frame)

    api_key = api_key_of(args)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"dflow-rt: warning: serving on {args.host} without an API key: anyone who reaches the port is "
              f"served (--api-key or DFLOW_RT_API_KEY)", file=sys.stderr, flush=True)
    app = create_app(engine, name, args.shutdown_grace, api_key)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=int(args.shutdown_grace) + 5))
    mode = engine.rt.config.mode + (" after eager rounds meanwhile" if engine.rt.compile_pending else "")
    print(f"dflow-rt: serving {name!r} on http://{args.host}:{args.port}/v1 (mode {mode}, "
          f"max batch {engine.rt.config.max_batch}, context {engine.max_len})", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal it stopped for once it is done; a no-op handler turns that into a
    # clean exit (status 0) after the drain instead of death by the default handler
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close()
    if not server.started:
        raise DflowError(f"could not serve on {args.host}:{args.port} (see the log above)")
