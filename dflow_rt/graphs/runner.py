"""Builds the callables that run one round per (batch, length) bucket, eager, compiled or captured."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch

from dflow_rt import compat
from dflow_rt.graphs import compile_cache
from dflow_rt.graphs.batched_round import decode_round
from dflow_rt.graphs.plan import RoundPlan
from dflow_rt.graphs.state import DecodeState
from dflow_rt.kernels.cpu import ops as cpu_ops

log = logging.getLogger("dflow_rt")
Bucket = tuple[int, int, bool, int, bool]  # (rows, cache length, greedy: no live row samples, verify width, lookup)


def build_rounds(target, drafter, state: DecodeState, plan: RoundPlan,
                 before: Callable[[int, int], None] | None = None,
                 cache: compile_cache.Entry | None = None) -> dict[Bucket, Callable[[], None]]:
    """One zero-argument callable per (rows, length, greedy, width, lookup) bucket of `plan`, running
    the round on rows [0, rows) over cache positions [0, length), verifying the first `width` drafted
    positions (`plan.round_widths(rows)`); the greedy variant (for rounds in which no row samples)
    skips the sampler (`batched_round.verify`); a lookup round verifies the host's drafts instead
    of the drafter's (`plan.graphs`). `before(rows, length)`, when given, runs on the host
    before every run of a bucket (FlashInfer's planning), outside any captured graph or compiled code.

    Compiled rounds are one graph per row count, variant and width with the cache length symbolic,
    or constant where the plan has one static length (`compiled_graphs`, from `cache` where given);
    each runs here at its shortest and longest length (no row is live yet, so these runs change no
    request): no step ever compiles (tested over lengths in between). Weights are graph inputs, not
    constants, unless `plan.freeze` (`compiling`). Compiled CPU rounds run eager where inductor has
    no C++ compiler to build them with (`compat.cpp_compiler`; said once).
    """
    mode = plan.mode
    if mode == "compile" and plan.compiler == "inductor" and state.tokens.device.type == "cpu" \
            and compat.cpp_compiler() is None:
        compat.say_no_compiler()
        mode = "eager"
    views = {(n, L): state.view(n, L) for n in plan.buckets for L in plan.lengths}
    graphs = {(n, g, k, lu): functools.partial(decode_round, target, drafter, plan=plan, width=k, greedy=g, lookup=lu)
              for n, g, k, lu in plan.graphs(greedy_variants(plan.mode, plan.sampling))}
    if mode != "eager":
        cpu_ops.enabled()  # built or loaded now: a trace never builds it
        with compiling(plan.compiler, state.tokens.device, plan.freeze):
            graphs = compiled_graphs(target, drafter, state, plan, views, list(graphs), cache)
    rounds = {(n, L, *key[1:]): functools.partial(graphs[key], view)
              for (n, L), view in views.items() for key in graphs if key[0] == n}
    if before is not None:  # each bucket planned before its first run (compiling or capturing)
        for n, L, *_ in rounds:
            before(n, L)
    with compiling(plan.compiler, state.tokens.device, plan.freeze) if mode != "eager" else contextlib.nullcontext():
        if mode == "cudagraph":
            rounds = capture_cuda_graphs(rounds)
        elif mode == "compile":  # each graph at its shortest and longest bucket: compiled (or loaded)
            for key, run in rounds.items():  # and its guards checked at both ends
                if key[1] in (plan.lengths[0], plan.lengths[-1]):
                    run()
            skip_guard_checks(rounds)
    if before is None:
        return rounds
    return {key: functools.partial(_planned, before, key[:2], run) for key, run in rounds.items()}


Graph = tuple[int, bool, int, bool]  # (rows, greedy, verify width, lookup)


def compiled_graphs(target, drafter, state: DecodeState, plan: RoundPlan, views: dict[tuple[int, int], DecodeState],
                    graphs: list[Graph], cache: compile_cache.Entry | None) -> dict[Graph, Callable]:
    """The compiled round of each graph, called with one of `views` (the buckets' views of `state`)
    of its row count. With `cache`, each is loaded from it, or compiled ahead of time and saved there.
    Without, or where ahead-of-time compilation fails, one `torch.compile` of the round serves every
    graph, compiling each on its first call: `views` are then marked, whereas a graph compiled ahead
    of time is traced from a view of its own (its guards, once saved, reject a marked view). On a
    torch `compat` does not know, `cache` is not used: every graph is the one `torch.compile`'s."""
    found, known = {}, compat.known()  # (said once where it is not)
    if cache is not None and known:
        models = (target, drafter)
        external = {name: m for name, m in (("target", target), ("drafter", drafter)) if m is not None}
        for n, g, k, lu in graphs:
            kwargs = {"plan": plan, "width": k, "greedy": g, "lookup": lu}
            name = f"rows{n}-width{k}-{'greedy' if g else 'sampling'}{'-lookup' if lu else ''}"
            fn = _cached_graph(cache, name, models, kwargs,
                               state.view(n, plan.lengths[0]), views[n, plan.lengths[0]], views[n, plan.lengths[-1]],
                               external=external)
            if fn is None:
                break
            found[n, g, k, lu] = functools.partial(fn, target, drafter, **kwargs)
        else:
            return found
    for view in views.values():  # the length as a symbol: one graph per row count, variant and width
        mark_length_dynamic(view, plan)
    lazy = _lazy_round(target, drafter, plan, len(graphs))
    return {(n, g, k, lu): functools.partial(lazy, width=k, greedy=g, lookup=lu) for n, g, k, lu in graphs}


def _cached_graph(cache: compile_cache.Entry, name: str, models: tuple, kwargs: dict, example: DecodeState,
                  *ends: DecodeState, external: dict) -> Callable | None:
    """Graph `name` from `cache` whose guards accept both `ends` (unmarked views of the shortest and
    longest length), else compiled ahead of time from `example` (a view of its own, marked here) and
    saved; None when that fails."""
    fn = cache.load(name, external)
    failed = fn is not None and _guard_failure(fn, models, ends, kwargs)
    if failed:
        cache.reject(name, f"does not fit this Runtime ({failed})")
        fn = None
    if fn is not None:
        return fn
    log.warning("compiling round %s (minutes on a CPU; kept in %s, from which later starts load it in about "
                "a second)", name, cache.dir)
    try:
        mark_length_dynamic(example, kwargs["plan"])
        with _without_grads(*models):
            fn = compat.aot_compile(decode_round, kwargs["plan"].compiler, (*models, example), kwargs)
        failed = _guard_failure(fn, models, ends, kwargs)
        if failed:
            raise RuntimeError(f"its guards reject this Runtime's state ({failed})")
    except Exception as err:  # noqa: BLE001  (any failure of the ahead-of-time path: the in-process one)
        log.warning("could not compile round %s ahead of time (%s: %s); compiling the rounds in-process, not "
                    "kept on disk", name, type(err).__name__, err)
        return None
    try:
        cache.save(name, fn, external)
    except OSError as err:  # a full or read-only disk: this process runs the graph all the same
        log.warning("could not keep round %s on disk (%s)", name, err)
    return fn


@contextlib.contextmanager
def _without_grads(*models) -> Iterator[None]:
    """The models' parameters without their `.grad` while a graph is traced, then as they were: a
    saved graph's guards record each parameter with its gradient, and torch cannot load back one
    that no guard covers (a model trained in the same process would leave its graphs unloadable)."""
    saved = [(p, p.grad) for m in models if m is not None for p in m.parameters() if p.grad is not None]
    for p, _ in saved:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in saved:
            p.grad = grad


def _guard_failure(fn, models: tuple, ends: tuple[DecodeState, ...], kwargs: dict) -> str:
    """Why the guards of compiled graph `fn` reject a call at either end, or "" when they accept both."""
    for view in ends:
        failed = compat.guard_failure(fn, (*models, view), kwargs)
        if failed:
            return failed
    return ""


def skip_guard_checks(rounds: dict[Bucket, Callable[[], None]]) -> None:
    """Rounds compiled ahead of time stop checking their guards on every call: 1.3 ms of a 7 ms
    compiled SmolLM2 step on CPU (docs/experiments.md), spent re-checking parameters, cache views and
    flags that were checked when the graph was loaded. What can still change under a Runtime (its
    models, torch's global flags) is checked by `guard_failure` when a request is admitted."""
    for run in filter(None, map(_ahead_of_time, rounds.values())):
        compat.skip_guard_checks(run.func)


def guard_failure(rounds: dict[Bucket, Callable[[], None]]) -> str:
    """Why the guards of a round compiled ahead of time reject its call now, or "" when they accept it
    (or no round was compiled ahead of time). One round stands for all: they guard the same models."""
    run = next(filter(None, map(_ahead_of_time, rounds.values())), None)
    if run is None:
        return ""
    *models, view = run.args
    return _guard_failure(run.func, tuple(models), (view,), run.keywords)


def _ahead_of_time(run: Callable[[], None]) -> functools.partial | None:
    """`run` (a bucket's round, or its `_planned` wrapper) when it calls a graph compiled ahead of
    time with its arguments bound (target, drafter, view; the graph's settings), else None."""
    if isinstance(run, functools.partial) and run.func is _planned:
        run = run.args[-1]
    return run if isinstance(run, functools.partial) and compat.is_ahead_of_time(run.func) else None


def _lazy_round(target, drafter, plan: RoundPlan, graphs: int) -> Callable:
    """The round under `torch.compile`, compiling each of its `graphs` on its first call: two
    lengths each at most (the shortest and longest bucket), beside dynamo's default allowance."""
    return compile_static(functools.partial(decode_round, target, drafter, plan=plan), plan.compiler,
                          recompiles=2 * graphs + 8)


def _planned(before: Callable[[int, int], None], key: tuple[int, int], run: Callable[[], None]) -> None:
    before(*key)
    run()


def greedy_variants(mode: str, sampling: bool) -> tuple[bool, ...]:
    """The round variants built per bucket: sampling, and greedy (which skips the sampler) except
    for `cudagraph`, where a second captured graph per bucket costs capture time and memory;
    greedy alone without `sampling`."""
    if not sampling:
        return (True,)
    return (False,) if mode == "cudagraph" else (False, True)


def compile_static(fn: Callable, compiler: str = "inductor", recompiles: int = 8) -> Callable:
    """`fn` compiled whole by torch.compile's backend `compiler` at fixed shapes (bar lengths marked
    dynamic) on its first call, `recompiles` graphs at most (its own, not shared with other compiled
    functions of the same code: `compat.compile_function`)."""
    return compat.compile_function(fn, compiler, recompiles)


@contextlib.contextmanager
def compiling(compiler: str, device: torch.device, freeze: bool = False) -> Iterator[None]:
    """Where compiled rounds run first (and so compile). On CPU inductor's wrapper around the
    kernels is C++, which saves about a millisecond of Python per round. `freeze` folds the
    weights into the graph as constants (prepacked for the CPU GEMM library, projections of one
    input merged into one GEMM), but torch's caches cannot store a frozen graph, so every start
    compiles again; unfrozen rounds start from the cache in seconds and decode 10-24 % slower on
    CPU (docs/RESULTS.md, "Compiled start"). Frozen on CPU, each product also tries inductor's C++
    GEMM templates against the GEMM library and keeps the faster: at batch 1 the template streams
    the weights at about the machine's read bandwidth, the library at about half of it
    (`bench/cpu_gemv.py`). Dynamo's process-wide cap on one function's graphs is lifted within
    (`compat.compiling`): every Runtime compiles the same round function."""
    settings = compat.inductor_settings(device.type == "cpu", freeze) if compiler == "inductor" \
        else contextlib.nullcontext()
    with compat.compiling(), settings:
        yield


def mark_length_dynamic(view: DecodeState, plan: RoundPlan) -> None:
    """Trace the cache length of `view` as a symbol: one graph serves every length bucket (and every
    max_len). Not for a plan with one static length, whose graphs skip the symbol's cost."""
    if plan.static_length:
        return
    for t in view.caches():
        compat.mark_dynamic(t, 2)


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
