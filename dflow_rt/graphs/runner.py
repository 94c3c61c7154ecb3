"""Builds the callable that runs one round for a batch bucket, per backend."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from dflow_rt.graphs.round import decode_round
from dflow_rt.graphs.state import DecodeState


def build_rounds(target, drafter, state: DecodeState, buckets: tuple[int, ...], backend: str,
                 mask_token_id: int, layer_ids: tuple[int, ...],
                 compile_backend: str = "inductor") -> dict[int, Callable[[], None]]:
    """One zero-argument callable per bucket size, each running the round on rows [0, n).

    Compiled rounds are compiled here, once per bucket (no row is live yet, so these runs
    change no request), so that no step ever compiles.
    """
    fn = functools.partial(decode_round, target, drafter, mask_token_id=mask_token_id, layer_ids=layer_ids)
    if backend != "eager":
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(buckets))
        fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=compile_backend)
    rounds = {n: functools.partial(fn, state.view(n)) for n in buckets}
    if backend == "cudagraph":
        return capture_cuda_graphs(rounds)
    if backend == "compile":
        for run in rounds.values():
            run()
    return rounds


def capture_cuda_graphs(rounds: dict[int, Callable[[], None]]) -> dict[int, Callable[[], None]]:
    """Capture each bucket's round, largest first so that the smaller ones fit in the pool
    the largest reserved. Warm-up runs (which also compile) go on a side stream first.
    Rows are inactive during capture, so the rounds run here move no request state.
    """
    pool, graphs = torch.cuda.graph_pool_handle(), {}
    for n in sorted(rounds, reverse=True):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                rounds[n]()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            rounds[n]()
        graphs[n] = graph.replay
    return graphs
