"""Runtime: continuous batching of speculative decoding, one round per `step()`.

All device state is preallocated (`DecodeState`); a step admits waiting requests into free
rows (prefill writes only its own row), runs one static round for the smallest batch bucket
covering the live rows, and copies one small tensor to the host: the tokens emitted.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import random
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from dflow_rt import compat
from dflow_rt.checks import check_fits, check_int, check_sampling, cut_at_stop, prompt_tensor, stop_set
from dflow_rt.config import RuntimeConfig
from dflow_rt.engine.limits import check_memory, rotary_growth, row_bytes
from dflow_rt.engine.policy import UNTIMED, RoundPolicy, TimingsFile
from dflow_rt.engine.request import Request
from dflow_rt.engine.scheduler import Scheduler
from dflow_rt.engine.settings import resolve_config
from dflow_rt.errors import BusyError, InputError, RequestError
from dflow_rt.graphs import compile_cache
from dflow_rt.graphs.plan import RoundPlan, static_length
from dflow_rt.graphs.prefill import prefill
from dflow_rt.graphs.runner import build_rounds, guard_failure
from dflow_rt.graphs.state import DecodeState
from dflow_rt.kernels.cpu import ops as cpu_ops
from dflow_rt.models import cache_pages, exact_codes, huge_pages

log = logging.getLogger("dflow_rt")
FAULT = "its logits became NaN or infinite (a numerical fault in its row, which was cleaned; other requests go on)"


class Runtime:
    def __init__(self, target, drafter=None, config: RuntimeConfig | None = None):
        c = resolve_config(RuntimeConfig() if config is None else config, target, drafter)
        self.config = c
        if c.mode == "cudagraph" and target.lm_head.weight.device.type != "cuda":
            raise InputError("mode 'cudagraph' needs the models on a CUDA device")
        self.target, self.drafter = target, drafter
        cpu = target.lm_head.weight.device.type == "cpu"
        if cpu and cpu_ops.deferred() and not (c.eager_start and self._keeps_rounds()):
            cpu_ops.resume(build=True)  # no background build comes to make the kernels: made here, now
        self.kernels_pending = cpu and cpu_ops.deferred()  # torch's ops serve until they are on disk
        self.plan = plan = RoundPlan.of(c, target, drafter)
        # the cache's: a static plan rounds its length up (as it will once pending kernels serve)
        positions = max(c.max_len, plan.lengths[-1], static_length(c.max_len) if self.kernels_pending else 0)
        paged = cache_pages.available(target.lm_head.weight.device)  # rows resident as they write
        budget = check_memory(dataclasses.replace(c, max_len=positions), target, drafter, plan.block_size, paged)
        self.scheduler = Scheduler(c.max_batch, budget, c.prefill_chunk, plan.lookup)
        self.rows = self.scheduler.rows  # the request each row serves (None: padding to the rounds)
        products = plan.kernels.implementations["linear"]  # the C++ kernels, or torch's ops
        if products == "torch":
            exact_codes.restore(target, drafter)  # weights held as codes need the kernel
        cpu_ops.route(products, target, drafter)
        huge_pages.place(target, drafter)  # CPU weights streamed each step: fewer page walks
        self.exact_codes = exact_codes.attach(target, drafter) if products == "cpu" else None  # fewer bytes a step
        if self.exact_codes and self.exact_codes["coded"]:
            log.info("weights in exact codes: %.0f MB of float32 streamed as %.0f MB",
                     self.exact_codes["float32"] / 1e6, self.exact_codes["coded"] / 1e6)
        before = self.prepare_attention if hasattr(plan.kernels.attention, "plan") else None  # FlashInfer
        with rotary_growth(c.max_len, target, drafter):  # undone if construction fails
            self.state = DecodeState.allocate(target, drafter, c.max_batch, positions, plan.block_size)
            self._before, cache = before, self._compile_cache()
            # eager_start on an empty cache: eager rounds now, the compiled ones once on disk (`compile_rounds`)
            self.compile_pending = cache is not None and c.eager_start and (
                self.kernels_pending or not (cache.dir / compile_cache.META).exists())
            now, cache = (dataclasses.replace(plan, mode="eager"), None) if self.compile_pending else (plan, cache)
            with torch.inference_mode():
                self.rounds = build_rounds(target, drafter, self.state, now, before, cache)
            self.compile_cache_hit = cache is not None and cache.loaded > 0 and cache.saved == 0
        self.rounds_run = 0
        self._asked = 0.0  # when `_built_on_disk` last looked
        self._start_policy()
        self.requests: dict[int, Request] = {}
        self._rids = itertools.count()  # next() is atomic: add_request may run beside a step()
        self._stepping = threading.Lock()

    def _start_policy(self) -> None:
        """What compiled rounds check each step (the weights where they were built, and their exact
        codes), and the round policy, from the timings kept for these rounds (not while eager rounds
        stand in for compiled ones: their costs differ)."""
        c, plan, models = self.config, self.plan, [m for m in (self.target, self.drafter) if m is not None]
        compiled = c.mode != "eager" and not self.compile_pending
        self._coded = exact_codes.watch(*models) if compiled else []  # eager rounds check each product
        self._placed = [(p, p.data_ptr()) for m in models for p in m.parameters()] if compiled else []
        self.policy = self.sampled_policy = self.timings = None  # greedy rounds' policy, sampled rounds'
        if plan.ar_fallback:
            widths = {n: plan.round_widths(n) for n in plan.buckets}
            self.policy, self.sampled_policy = RoundPolicy(widths), RoundPolicy(widths)
            if c.keep_timings and not self.compile_pending:
                self.timings = TimingsFile.of(self.target, self.drafter, self.plan)
                kept = self.timings.load()
                self.policy.restore(kept.get("greedy", {}))
                self.sampled_policy.restore(kept.get("sampled", {}))

    def compile_rounds(self) -> bool:
        """Switch an `eager_start` Runtime to its compiled rounds: loaded from the disk cache where
        another process built them (seconds), else compiled here (minutes). Only while no request
        holds a row, since building runs each round once over the rows; False (nothing done) else.
        `step()` does it by itself when the compiled rounds appear on disk between requests."""
        with self._exclusive("compile_rounds"), torch.inference_mode():
            return self._switch_to_compiled(here=True)

    def _switch_to_compiled(self, here: bool = False) -> bool:
        if not self.compile_pending:
            return True
        if any(row is not None for row in self.rows):
            return False
        if self.kernels_pending:
            self._switch_kernels(build=here)
            if not here:
                return False  # the compiled rounds once they are on disk too
        cache = self._compile_cache()
        self.rounds = build_rounds(self.target, self.drafter, self.state, self.plan, self._before, cache)
        self.compile_cache_hit = cache is not None and cache.loaded > 0 and cache.saved == 0
        self.compile_pending = False
        self._start_policy()
        log.info("compiled rounds in use (%s)", "from the disk cache" if self.compile_cache_hit else "compiled here")
        return True

    def _switch_kernels(self, build: bool = False) -> None:
        """Onto the C++ kernels a background build put on disk (with `build`: built here if they are
        not), between requests: the weights held as their codes, the plan made again (where compiled,
        the C++ attention's static length) and eager rounds over it until the compiled ones are on disk."""
        cpu_ops.resume(build)
        if cpu_ops.deferred():
            return
        self.kernels_pending = False
        self.plan = RoundPlan.of(self.config, self.target, self.drafter)
        cpu = self.plan.kernels.implementations["linear"] == "cpu"
        self.exact_codes = exact_codes.attach(self.target, self.drafter) if cpu else None
        eager = dataclasses.replace(self.plan, mode="eager")
        self.rounds = build_rounds(self.target, self.drafter, self.state, eager, self._before, None)
        self._start_policy()
        log.info("the C++ kernels are in use%s", "" if cpu_ops.enabled() else ": their library failed to load")

    def _keeps_rounds(self) -> bool:
        """Whether compiled rounds are kept on disk: not for eager, another compiler than inductor, frozen
        weights, opted out, a torch `compat` does not know, or CPU rounds without a C++ compiler (eager)."""
        c = self.config
        if c.mode == "eager" or c.compiler != "inductor" or not c.compile_cache or c.freeze or not compat.known():
            return False
        return self.target.lm_head.weight.device.type != "cpu" or compat.cpp_compiler() is not None

    def _compile_cache(self) -> compile_cache.Entry | None:
        """The disk cache's entry for these rounds, or None where rounds are not kept."""
        if not self._keeps_rounds():
            return None
        return compile_cache.Entry(*compile_cache.entry_key(self.target, self.drafter, self.plan.graph_settings()))

    def _built_on_disk(self) -> bool:
        """Whether what this eager-started Runtime waits for (the C++ kernels, then its compiled rounds)
        is on disk now, and no row is live; the disk is asked at most once a second."""
        now = time.monotonic()
        if any(row is not None for row in self.rows) or now - self._asked < 1.0:
            return False
        self._asked = now
        if self.kernels_pending:
            return cpu_ops.on_disk()
        cache = self._compile_cache()
        return cache is not None and (cache.dir / compile_cache.META).exists()

    def add_request(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int = 256,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    stop_token_ids: Sequence[int] = (), seed: int | None = None) -> int:
        """Queue a request; it joins the batch at the next `step()` with a free row.

        Every field is checked here (`dflow_rt.checks`): a bad one raises `InputError` now, and
        nothing a queued request carries can make a later `step()` fail."""
        vocab = self.target.config.vocab_size
        prompt = prompt_tensor(prompt_ids, vocab, self.state.tokens.device)[0]
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        check_fits(prompt.numel(), max_new_tokens, self.plan.block_size, self.config.max_len)
        need = self._reservation(prompt.numel(), max_new_tokens)
        budget = self.scheduler.cache_budget
        if budget is not None and need > budget:
            raise InputError(f"a prompt of {prompt.numel()} tokens and {max_new_tokens} new ones need "
                             f"{need / 2**30:.2f} GiB of cache, more than this Runtime's {budget / 2**30:.2f} GiB")
        sampling = check_sampling(temperature, top_k, top_p, seed, vocab)
        if sampling.temperature > 0 and not self.plan.sampling:
            raise InputError(f"temperature {sampling.temperature}: this Runtime has greedy rounds only "
                             f"(RuntimeConfig(sampling=False)); build one with sampling=True to sample")
        stops = stop_set(stop_token_ids, vocab)
        rid = next(self._rids)
        seed = random.getrandbits(62) if sampling.seed is None else sampling.seed
        self.requests[rid] = req = Request(rid, prompt, max_new_tokens, stops, sampling.temperature, sampling.top_k,
                                           sampling.top_p, seed, need=need)
        self.scheduler.waiting.append(req)
        return rid

    def is_finished(self, rid: int) -> bool:
        return self._request(rid).finished

    def pop(self, rid: int) -> Request:
        """Forget a finished request and return its record (tokens, per-round acceptance).

        Records stay until popped, so a long-running caller of `step()` pops each request it
        has seen finish; `stream` and `generate` pop their own.
        """
        with self._exclusive("pop"):
            if not self._request(rid).finished:
                raise InputError(f"request {rid} is still running: cancel it or step until it finishes")
            return self.requests.pop(rid)

    def cancel(self, rid: int) -> None:
        """Stop a request (waiting or running) now; a finished one is left as it is."""
        with self._exclusive("cancel"):
            req = self._request(rid)
            if req.finished:
                return
            if req in self.scheduler.waiting:
                self.scheduler.waiting.remove(req)
            self._finish(req)

    def step(self) -> dict[int, list[int]]:
        """One round for every live request: {rid: tokens emitted by this round}.

        A request whose row produced a NaN or infinite logit gets no tokens from the round and
        ends with `Request.error` set; its row is cleaned, and every other row is untouched.
        One caller at a time: a step() (or cancel/pop) while a step() of this Runtime runs, from
        another thread or re-entrantly from code the round calls, raises BusyError at once (a
        non-blocking lock: nobody waits, and nobody changes the rows under a running round).
        """
        with self._exclusive("step"), torch.inference_mode():
            if self.compile_pending and self._built_on_disk():
                self._switch_to_compiled()  # only between requests: no row is live
            if self._coded and exact_codes.changed(self._coded):
                raise InputError("a weight of the models changed after this Runtime was built: its compiled "
                                 "rounds read the weights' exact codes from then (DFLOW_RT_EXACT_CODES); build "
                                 "a new Runtime")
            if any(p.data_ptr() != at for p, at in self._placed):  # 23 us for SmolLM2's 272 parameters
                raise InputError("a weight of the models was replaced after this Runtime was built (new data, "
                                 "dtype or shape): its compiled rounds were built for the old one; build a new "
                                 "Runtime")
            sched = self.scheduler
            if sched.waiting and sched.free_rows:  # compiled rounds check their guards here, not every step
                failed = guard_failure(self.rounds)
                if failed:
                    raise InputError(f"the models or torch's settings changed after this Runtime was built, and "
                                     f"its compiled rounds no longer fit them ({failed}): build a new Runtime")
            return self._step()

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if not self._stepping.acquire(blocking=False):
            raise BusyError(f"{what}() while a step() of this Runtime is running (another thread, or re-entrant): "
                            f"a Runtime serves one caller at a time")
        try:
            yield
        finally:
            self._stepping.release()

    def prepare_attention(self, rows: int, length: int, starts: list[int] | None = None) -> None:
        """FlashInfer's host-side plan before a round of bucket (rows, length); nothing for the other
        attention kernels. Each row starts at `starts`, by default its request's position (the
        device's `start`, known here without a read), padding at 0."""
        if not hasattr(self.plan.kernels.attention, "plan"):
            return
        if starts is None:
            starts = [0 if r is None else r.position for r in self.rows[:rows]]
        blocks = {True: self.plan.widths[rows], False: self.plan.block_size}  # queries per row: verify, draft
        self.plan.kernels.attention.plan(rows, length, starts, blocks, self.state.tokens.device)

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    def bucket(self, rows: int, position: int) -> tuple[int, int]:
        """The (batch, length) bucket of a round over rows [0, rows) whose furthest block starts at `position`."""
        p = self.plan
        n = p.buckets[bisect.bisect_left(p.buckets, rows)]
        return n, p.lengths[bisect.bisect_left(p.lengths, position + p.block_size)]

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the last step prefilled."""
        return self.scheduler.prefill_tokens

    def _step(self) -> dict[int, list[int]]:
        for group, end in self.scheduler.admit():
            prefill(self.state, self.plan, self.target, self.drafter, group, end)
        held = [r for r in self.rows if r is not None]  # rows still prefilling are padding to the round
        live = [r for r in held if r.prefilled == r.prompt.numel()]
        if not live:
            return {}
        n = self.bucket(max(r.row for r in live) + 1, 0)[0]
        length = self.bucket(n, max(r.position for r in held if r.row < n))[1]  # padding's block fits too
        greedy = (n, length, True, self.plan.widths[n], False) in self.rounds and all(r.temperature == 0 for r in live)
        policy = self.policy if greedy else self.sampled_policy
        width = self.plan.widths[n] if policy is None else policy.width(n)
        drafts = self._lookup_drafts(live, self.plan.widths[n] - 1) if self.plan.lookup else None
        lookup = drafts is not None and policy.lookup(n, width)
        if lookup:
            width = self.plan.widths[n]
            self.state.lookup[[req.row for req in live], :width - 1] = drafts
        t0 = time.perf_counter()
        self.rounds[n, length, greedy, width, lookup]()
        out = self.state.out[:n].tolist()  # the one host read of the round; the last column flags faults
        seconds = time.perf_counter() - t0
        for row, values in enumerate(out):
            if values[-1] and self.rows[row] is None:  # padding that went non-finite: clean before reuse
                self.state.clean(row)
        result, made, ended = {}, [], False
        for req in live:
            if out[req.row][-1]:
                result[req.rid] = []
                self._fail(req, FAULT)
                continue
            count = out[req.row][0]
            new = count - (0 if req.emitted else 1)  # the first round also reports prefill's token
            req.position += new
            req.acceptance.append(new)
            req.plain_steps += width == 1
            req.lookup_rounds += lookup
            req.lookup_tokens += new if lookup else 0
            made.append(new)
            tokens, stopped = cut_at_stop(out[req.row][1:1 + count][: req.max_new_tokens - len(req.emitted)], req.stop)
            req.finished |= stopped
            req.emitted += tokens
            if req.text is not None:
                req.text.extend(tokens)
            result[req.rid] = tokens
            if req.finished or len(req.emitted) >= req.max_new_tokens:
                self._finish(req)
                ended = True
        self.rounds_run += 1
        if policy is not None and made:
            seconds = seconds if self.rounds_run > UNTIMED else None  # cold caches: counted, not timed
            if lookup:
                policy.record_lookup(n, seconds, made)
            else:
                policy.record(n, width, seconds, made)
            if ended and self.timings is not None:
                self.timings.save({"greedy": self.policy.state(), "sampled": self.sampled_policy.state()},
                                  force=self.timings.saved_at is None)
        return result

    def _lookup_drafts(self, live: list[Request], count: int) -> torch.Tensor | None:
        """Each live row's lookup drafts, `count` tokens (the mask token past what its text offers),
        or None when no row has any."""
        # a row's text ends at its block slot 0 once the first round has reported that token
        drafts = [req.text.drafts(count) if req.emitted else [] for req in live]
        if not any(drafts):
            return None
        padded = [d + [self.plan.filler] * (count - len(d)) for d in drafts]
        return torch.tensor(padded, device=self.state.lookup.device)

    def stream(self, prompt_ids, **kwargs) -> Iterator[list[int]]:
        """Tokens of one request as rounds produce them, every one of them: a round that another
        caller's step() ran (another stream, say) leaves this request's tokens in its record until
        this stream yields them. A failed request raises RequestError after its good tokens."""
        rid = self.add_request(prompt_ids, **kwargs)
        try:
            while True:
                req = self._request(rid)
                if req.delivered < len(req.emitted):
                    tokens, req.delivered = req.emitted[req.delivered:], len(req.emitted)
                    yield tokens
                elif req.finished:
                    break
                else:
                    self.step()
            if req.error is not None:
                raise RequestError(rid, req.error)
        finally:  # also when the consumer stops early
            self._drop([rid])

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> list[list[int]]:
        """The new tokens of every prompt. A bad prompt raises InputError and a failed request
        RequestError; either way none of this call's requests is left in the Runtime."""
        rids: list[int] = []
        try:
            for p in prompts:
                rids.append(self.add_request(p, **kwargs))
            while not all(self.is_finished(r) for r in rids):
                self.step()
            failed = next((self.requests[r] for r in rids if self.requests[r].error is not None), None)
            if failed is not None:
                raise RequestError(failed.rid, failed.error)
            return [self.requests[r].emitted for r in rids]
        finally:
            self._drop(rids)

    def _drop(self, rids: list[int]) -> None:
        """Cancel and forget the requests of a `stream` or `generate` call that is ending."""
        for rid in rids:
            if rid in self.requests:
                self.cancel(rid)
                self.pop(rid)

    def _fail(self, req: Request, problem: str) -> None:
        req.error, row = problem, req.row
        self._finish(req)
        self.state.clean(row)

    def _request(self, rid: int) -> Request:
        if rid not in self.requests:
            raise InputError(f"no request {rid}: never added, or already popped")
        return self.requests[rid]

    def _reservation(self, prompt: int, max_new_tokens: int) -> int:
        """Cache bytes a request may write (its prompt, answer and a block past it) where rows are paged."""
        return row_bytes(self.target, self.drafter, prompt + max_new_tokens + self.plan.block_size)

    def _finish(self, req: Request) -> None:
        req.finished = True
        row = self.scheduler.release(req)
        if row >= 0:  # the row keeps running as padding until it is reused
            self.state.release(row)
            self.state.park(row)
