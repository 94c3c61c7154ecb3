"""Builds the callables that run one round per (batch, length) bucket, eager, compiled or captured."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from dflow_rt.graphs.batched_round import decode_round
from dflow_rt.graphs.plan import RoundPlan
from dflow_rt.graphs.state import DecodeState
from dflow_rt.models import cpu_gemv

Bucket = tuple[int, int, bool, int]  # (rows, cache length, greedy: no live row samples, verify width)


def build_rounds(target, drafter, state: DecodeState, plan: RoundPlan,
                 before: Callable[[int, int], None] | None = None) -> dict[Bucket, Callable[[], None]]:
    """One zero-argument callable per (rows, length, greedy, width) bucket of `plan`, running the
    round on rows [0, rows) over cache positions [0, length), verifying the first `width` drafted
    positions (`plan.round_widths(rows)`); the greedy variant (for rounds in which no row samples)
    skips the sampler (`batched_round.verify`). `before(rows, length)`, when given, runs on the host
    before every run of a bucket (FlashInfer's planning), outside any captured graph or compiled code.

    Compiled rounds trace one graph per row count, variant and width with the cache length symbolic;
    each runs here at its shortest and longest length (no row is live yet, so these runs
    change no request): no step ever compiles (tested over lengths in between). Weights are
    graph inputs, not constants, unless `plan.freeze` (`compiling`), so torch's caches can keep the code.
    """
    views = {(n, L): state.view(n, L) for n in plan.rows for L in plan.lengths}
    variants = greedy_variants(plan.mode)
    fn = functools.partial(decode_round, target, drafter, plan=plan)
    if plan.mode != "eager":
        # every Runtime adds its graphs (two lengths x variants x widths per row count) to the round's code object
        cfg, graphs = torch._dynamo.config, 2 * sum(map(len, map(plan.round_widths, plan.rows))) * len(variants)
        cfg.recompile_limit += graphs
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, cfg.recompile_limit)
        for view in views.values():
            mark_length_dynamic(view)
        cpu_gemv.enabled()  # built or loaded now: a trace never builds it
        fn = compile_static(fn, plan.compiler)
    rounds = {(n, L, g, k): functools.partial(fn, view, width=k, greedy=g)
              for (n, L), view in views.items() for g in variants for k in plan.round_widths(n)}
    if before is not None:  # each bucket planned before its first run (compiling or capturing)
        for n, L, *_ in rounds:
            before(n, L)
    with compiling(plan.compiler, state.tokens.device, plan.freeze):
        if plan.mode == "cudagraph":
            rounds = capture_cuda_graphs(rounds)
        elif plan.mode == "compile":  # the graph has a symbolic length: the shortest and longest bucket
            for key, run in rounds.items():  # of each graph compile it and check its guards at both ends
                if key[1] in (plan.lengths[0], plan.lengths[-1]):
                    run()
    if before is None:
        return rounds
    return {key: functools.partial(_planned, before, key[:2], run) for key, run in rounds.items()}


def _planned(before: Callable[[int, int], None], key: tuple[int, int], run: Callable[[], None]) -> None:
    before(*key)
    run()


def greedy_variants(mode: str) -> tuple[bool, ...]:
    """The round variants built per bucket: sampling, and greedy (which skips the sampler) except
    for `cudagraph`, where a second captured graph per bucket costs capture time and memory."""
    return (False,) if mode == "cudagraph" else (False, True)


def compile_static(fn: Callable, compiler: str = "inductor") -> Callable:
    """`fn` compiled whole by torch.compile's backend `compiler` at fixed shapes (bar lengths marked
    dynamic) on its first call."""
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=compiler)


def compiling(compiler: str, device: torch.device, freeze: bool = False) -> contextlib.AbstractContextManager:
    """Where compiled rounds run first (and so compile). On CPU inductor's wrapper around the
    kernels is C++, which saves about a millisecond of Python per round. `freeze` folds the
    weights into the graph as constants (prepacked for the CPU GEMM library, projections of one
    input merged into one GEMM), but torch's caches cannot store a frozen graph, so every start
    compiles again; unfrozen rounds start from the cache in seconds and decode 10-24 % slower on
    CPU (docs/RESULTS.md, "Compiled start"). Frozen on CPU, each product also tries inductor's C++
    GEMM templates against the GEMM library and keeps the faster: at batch 1 the template streams
    the weights at about the machine's read bandwidth, the library at about half of it
    (`bench/cpu_gemv.py`)."""
    if compiler != "inductor":
        return contextlib.nullcontext()
    cpu = device.type == "cpu"
    templates = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"} if freeze and cpu else {}
    return torch._inductor.config.patch({"freezing": freeze, "cpp_wrapper": cpu, "cpp.enable_concat_linear": cpu,
                                         **templates})


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
