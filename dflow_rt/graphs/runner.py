"""Builds the callables that run one round per (batch, length) bucket, per backend."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from dflow_rt.graphs.batched_round import decode_round
from dflow_rt.graphs.state import DecodeState
from dflow_rt.kernels import Kernels

Bucket = tuple[int, int, bool]  # (rows, cache length, greedy: no live row samples)


def build_rounds(target, drafter, state: DecodeState, buckets: tuple[int, ...], lengths: tuple[int, ...],
                 backend: str, mask_token_id: int, layer_ids: tuple[int, ...],
                 compile_backend: str = "inductor", widths: dict[int, int] | None = None,
                 kernels: Kernels | None = None,
                 plan: Callable[[int, int], None] | None = None,
                 emit_mask_token: bool = False, freeze: bool = False) -> dict[Bucket, Callable[[], None]]:
    """One zero-argument callable per (rows, length, greedy) bucket, running the round on rows
    [0, rows) over cache positions [0, length), verifying the first `widths[rows]` drafted
    positions, with the fused ops of `kernels`; the greedy variant (for rounds in which no row
    samples) skips the sampler (`batched_round.verify`). `plan(rows, length)`, when given, runs
    on the host before every run of a bucket (FlashInfer's planning), outside any captured
    graph or compiled code.

    Compiled rounds trace one graph per row count and variant with the cache length symbolic;
    each runs here at its shortest and longest length (no row is live yet, so these runs
    change no request): no step ever compiles (tested over lengths in between). Weights are
    graph inputs, not constants, unless `freeze` (`compiling`), so torch's caches can keep the code.
    """
    views = {(n, L): state.view(n, L) for n in buckets for L in lengths}
    variants = greedy_variants(backend)
    fn = functools.partial(decode_round, target, drafter, mask_token_id=mask_token_id, layer_ids=layer_ids,
                           kernels=kernels, emit_mask_token=emit_mask_token)
    if backend != "eager":
        # every Runtime adds its graphs (two lengths x variants per row count) to the round's code object
        cfg, graphs = torch._dynamo.config, 2 * len(buckets) * len(variants)
        cfg.recompile_limit += graphs
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, cfg.recompile_limit)
        for view in views.values():
            mark_length_dynamic(view)
        fn = compile_static(fn, compile_backend)
    widths = widths or {}
    rounds = {(n, L, g): functools.partial(fn, view, verify_width=widths.get(n), greedy=g)
              for (n, L), view in views.items() for g in variants}
    if plan is not None:  # each bucket planned before its first run (compiling or capturing)
        for n, L, _ in rounds:
            plan(n, L)
    with compiling(compile_backend, state.tokens.device, freeze):
        if backend == "cudagraph":
            rounds = capture_cuda_graphs(rounds)
        elif backend == "compile":  # the graph has a symbolic length: the shortest and longest bucket
            for n in buckets:        # of each row count compile it and check its guards at both ends
                for L in (lengths[0], lengths[-1]):
                    for g in variants:
                        rounds[n, L, g]()
    if plan is None:
        return rounds
    return {key: functools.partial(_planned, plan, key[:2], run) for key, run in rounds.items()}


def _planned(plan: Callable[[int, int], None], key: tuple[int, int], run: Callable[[], None]) -> None:
    plan(*key)
    run()


def greedy_variants(backend: str) -> tuple[bool, ...]:
    """The round variants built per bucket: sampling, and greedy (which skips the sampler) except
    for `cudagraph`, where a second captured graph per bucket costs capture time and memory."""
    return (False,) if backend == "cudagraph" else (False, True)


def compile_static(fn: Callable, compile_backend: str = "inductor") -> Callable:
    """`fn` compiled whole at fixed shapes (bar lengths marked dynamic) on its first call."""
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=compile_backend)


def compiling(compile_backend: str, device: torch.device, freeze: bool = False) -> contextlib.AbstractContextManager:
    """Where compiled rounds run first (and so compile). On CPU inductor's wrapper around the
    kernels is C++, which saves about a millisecond of Python per round. `freeze` folds the
    weights into the graph as constants (prepacked for the CPU GEMM library, projections of one
    input merged into one GEMM), but torch's caches cannot store a frozen graph, so every start
    compiles again; unfrozen rounds start from the cache in seconds and decode 10-24 % slower on
    CPU (docs/RESULTS.md, "Compiled start")."""
    if compile_backend != "inductor":
        return contextlib.nullcontext()
    cpu = device.type == "cpu"
    return torch._inductor.config.patch({"freezing": freeze, "cpp_wrapper": cpu, "cpp.enable_concat_linear": cpu})


def mark_length_dynamic(view: DecodeState) -> None:
    """Trace the cache length of `view` as a symbol: one graph serves every length bucket."""
    for t in view.caches():
        torch._dynamo.mark_dynamic(t, 2)


def capture_cuda_graphs(rounds: dict[Bucket, Callable[[], None]]) -> dict[Bucket, Callable[[], None]]:
    """Capture each bucket's round, largest first so that the smaller ones fit in the pool
    the largest reserved. Warm-up runs (which also compile) go on a side stream first.
    Rows are inactive during capture, so the rounds run here move no request state.
    """
    pool, graphs = torch.cuda.graph_pool_handle(), {}
    for key in sorted(rounds, reverse=True):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                rounds[key]()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            rounds[key]()
        graphs[key] = graph.replay
    return graphs
