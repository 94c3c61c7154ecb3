"""The one loop that owns the Runtime: requests join and leave between its steps.

A Runtime serves one caller at a time (`BusyError` otherwise), so a single thread makes every
call on it: it takes new requests from an inbox, frees the rows of hung-up or cancelled ones,
runs one `step()`, and hands each request's new text to the asyncio loop of the HTTP handler
that waits for it. Handlers never touch the Runtime; they check a request at the door (`check`,
`submit`: the errors a client can fix, and a bounded queue) and read their `Handle`'s events.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflow_rt.checks import check_sampling, prompt_tensor, stop_set
from dflow_rt.errors import InputError
from dflow_rt.serve.metrics import Metrics
from dflow_rt.serve.text import Detokenizer

if TYPE_CHECKING:
    from dflow_rt.engine.runtime import Runtime

FINISHED_BY_SERVER = ("error", "shutdown")


class Refused(Exception):
    """A request the server will not take, as the HTTP status and OpenAI error fields to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class Params:
    """A request: everything the Runtime needs, in its own terms (`Engine.check` checks it; only an
    unchecked one may leave `max_tokens` None, for as many as fit)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Event:
    """New text of one request; the last event has `finish` set (stop, length, cancelled, error,
    shutdown), `error` says why for the last two, and `text` of all events adds up to the answer."""

    text: str = ""
    finish: str | None = None
    error: str | None = None
    completion_tokens: int = 0


@dataclass(eq=False)
class Handle:
    """A request's side of the engine. Events arrive on the asyncio loop that submitted it."""

    engine: Engine
    params: Params
    loop: asyncio.AbstractEventLoop
    events_q: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    rid: int | None = None  # the Runtime's id, once the engine added it
    detok: Detokenizer | None = None
    tokens: int = 0  # tokens of the answer so far
    cancel_step: int | None = None  # engine.steps when cancel() was called
    finished: bool = False

    def cancel(self) -> None:
        """Free the request's row before the next step (any thread; a finished request is left alone)."""
        if self.cancel_step is None and not self.finished:
            self.cancel_step = self.engine.steps
            self.engine._cancels.put(self)
            self.engine._wake.set()

    async def events(self) -> AsyncIterator[Event]:
        """Events until the last one; events that queued up meanwhile come merged into one."""
        while True:
            event = await self.events_q.get()
            while event.finish is None and not self.events_q.empty():
                more = self.events_q.get_nowait()
                event = Event(event.text + more.text, more.finish, more.error, more.completion_tokens)
            yield event
            if event.finish is not None:
                return


class Engine:
    """Owns `runtime` in one thread; `max_queue` requests may wait for a row beyond the running ones
    (see `_admit` for how newcomers join the running streams)."""

    def __init__(self, runtime: Runtime, tokenizer, max_queue: int = 64, stop_token_ids: Sequence[int] = ()):
        self.rt, self.tokenizer = runtime, tokenizer
        self.max_len, self.block = runtime.config.max_len, runtime.block_size
        self.vocab = runtime.target.config.vocab_size
        self.capacity = runtime.config.max_batch + max_queue
        self.stop_token_ids = tuple(stop_token_ids)  # always stop here (end of text, end of turn)
        self.metrics = Metrics(self.block)
        self.steps = 0
        self._inbox: queue.SimpleQueue[Handle] = queue.SimpleQueue()  # submitted, not yet seen by the loop
        self._pending: deque[Handle] = deque()  # seen, waiting for a row
        self._cancels: queue.SimpleQueue[Handle] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, Handle] = {}
        self._lock = threading.Lock()
        self._in_flight = 0  # submitted and not finished: bounded by `capacity`
        self._drain_at: float | None = None
        self._closing = False
        self.failure: str | None = None  # what stopped the loop, if a bug did
        self._thread: threading.Thread | None = None
        self.metrics.running.set_function(self.running)
        self.metrics.queue_depth.set_function(lambda: max(0, self._in_flight - self.running()))

    # -- the handlers' side -------------------------------------------------------------------
    def check(self, asked: Params, default_max_tokens: int | None = None, prompt_param: str = "prompt") -> Params:
        """`asked` checked, with `max_tokens` filled in (at most `default_max_tokens` when it asked for
        none), or `Refused` (400) naming the field to fix (the prompt's as `prompt_param`)."""
        prompt_ids, max_tokens = asked.prompt_ids, asked.max_tokens
        try:
            prompt_tensor(list(prompt_ids), self.vocab, "cpu")
        except InputError as err:
            raise Refused(400, str(err).replace("prompt_ids", prompt_param), prompt_param) from None
        room = self.max_len - self.block - len(prompt_ids)
        if room < 1:
            raise Refused(400, f"the prompt is {len(prompt_ids)} tokens: this server takes at most "
                          f"{self.max_len - self.block - 1} (context {self.max_len}, less one new token and one "
                          f"drafted block of {self.block})", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max_tokens or room, room)
        elif max_tokens > room:
            raise Refused(400, f"max_tokens {max_tokens} does not fit with a prompt of {len(prompt_ids)} tokens: "
                          f"at most {room} here (context {self.max_len})", "max_tokens", "context_length_exceeded")
        try:
            sampling = check_sampling(asked.temperature, asked.top_k, asked.top_p, asked.seed, self.vocab)
            stops = stop_set(asked.stop_token_ids, self.vocab)
        except InputError as err:
            raise Refused(400, str(err), str(err).split()[0].rstrip("[]")) from None
        if any(not s for s in asked.stop):
            raise Refused(400, "stop strings must not be empty", "stop")
        return Params(tuple(prompt_ids), max_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
                      sampling.seed, tuple(asked.stop), tuple(sorted(stops)))

    def submit(self, params: Params) -> Handle:
        """Queue a checked request (from a coroutine): `Refused` 429 when the queue is full, 503 when
        the server is shutting down."""
        if self._closing or self._drain_at is not None or not self.alive():
            self.metrics.rejected.labels("503").inc()
            why = f"its decoding loop stopped ({self.failure})" if self.failure else "it is shutting down"
            raise Refused(503, f"the server takes no requests: {why}", code="unavailable")
        with self._lock:
            if self._in_flight >= self.capacity:
                self.metrics.rejected.labels("429").inc()
                raise Refused(429, f"the server is full ({self.capacity} requests running or waiting): retry "
                              f"later", code="queue_full")
            self._in_flight += 1
        handle = Handle(self, params, asyncio.get_running_loop())
        self._inbox.put(handle)
        self._wake.set()
        return handle

    def running(self) -> int:
        """Requests holding a row of the Runtime now."""
        return sum(r is not None for r in self.rt.rows)

    def in_flight(self) -> int:
        """Requests submitted and not finished (running or waiting)."""
        return self._in_flight

    # -- lifetime -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dflow-rt-engine", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drain(self, grace_s: float) -> None:
        """Refuse new requests; let running ones finish for `grace_s` seconds, then end them.
        Only assigns an attribute, so a signal handler may call it."""
        if self._drain_at is None:
            self._drain_at = time.monotonic() + grace_s

    def close(self, timeout_s: float = 30.0) -> None:
        """End every request still there (finish reason `shutdown`) and stop the thread."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                self._take_new()
                self._take_cancels()
                self._admit()
                if self._closing or (self._drain_at is not None and time.monotonic() >= self._drain_at):
                    self._end_all("shutdown", "the server shut down before the request finished")
                    if self._closing:
                        return
                if not self._live:
                    self._wake.wait(None if self._drain_at is None else 0.1)
                    continue
                self._step()
        except BaseException as err:  # a bug: answer every waiting client rather than leave it hanging
            self.failure = f"{type(err).__name__}: {err}"
            self._end_all("error", f"server error: {self.failure}")
            raise

    def _take_new(self) -> None:
        while True:
            try:
                self._pending.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _take_cancels(self) -> None:
        while True:
            try:
                h = self._cancels.get_nowait()
            except queue.Empty:
                return
            if h.rid in self._live:
                self.rt.cancel(h.rid)
                self._retire(h, "cancelled")
                self.metrics.cancel_lag.observe(self.steps - h.cancel_step)
            elif h.rid is None and not h.finished:  # hung up while waiting for a row
                self._pending.remove(h)
                self._finish(h, "cancelled")

    def _admit(self) -> None:
        """Waiting requests into free rows. The Runtime prefills them inside its steps, at most
        `RuntimeConfig.prefill_chunk` prompt tokens a step while other rows decode (`serve
        --max-prefill-tokens`), so a newcomer stalls the running streams for one chunk."""
        free = self.rt.config.max_batch - len(self._live)
        while self._pending and free > 0:
            h = self._pending.popleft()
            p = h.params
            try:
                h.rid = self.rt.add_request(list(p.prompt_ids), max_new_tokens=p.max_tokens, temperature=p.temperature,
                                            top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                                            stop_token_ids=self.stop_token_ids + p.stop_token_ids)
            except InputError as err:  # `check` let through what add_request refuses: still the client's fault
                self._finish(h, "error", str(err))
                continue
            h.detok = Detokenizer(self.tokenizer, p.stop)
            self._live[h.rid] = h
            self.metrics.prompt_tokens.inc(len(p.prompt_ids))
            free -= 1

    def _step(self) -> None:
        t0 = time.perf_counter()
        out = self.rt.step()
        now = time.perf_counter()
        self.steps += 1
        self.metrics.step_seconds.labels("yes" if self.rt.prefill_tokens else "no").observe(now - t0)
        self.metrics.batch_rows.observe(len(out))
        for rid, tokens in out.items():
            h = self._live.get(rid)
            if h is None:
                continue
            req = self.rt.requests[rid]
            if tokens:
                if h.tokens == 0:
                    self.metrics.ttft.observe(now - h.arrived)
                self.metrics.tokens_per_round.observe(req.acceptance[-1])
                delta, used = h.detok.add(tokens)
                h.tokens += used
                self.metrics.generation_tokens.inc(used)
                if h.detok.stopped:  # a stop string: the answer ends inside this round's tokens
                    self.rt.cancel(rid)
                    self._retire(h, "stop", delta)
                    continue
                if delta:
                    self._post(h, Event(delta, completion_tokens=h.tokens))
            if req.finished:
                stopped = bool(req.emitted) and req.emitted[-1] in req.stop
                self._retire(h, "error" if req.error else "stop" if stopped else "length")

    def _retire(self, h: Handle, reason: str, text: str = "", error: str | None = None) -> None:
        """Forget a finished (or just cancelled) request in the Runtime and answer its client."""
        req = self.rt.pop(h.rid)
        del self._live[h.rid]
        self._finish(h, reason, error or req.error, text)

    def _end_all(self, reason: str, error: str) -> None:
        for h in list(self._live.values()):
            try:
                self.rt.cancel(h.rid)  # a finished one is left as it is
                self.rt.pop(h.rid)
            except Exception:  # noqa: BLE001 - after a bug in a step: its client is answered all the same
                pass
            del self._live[h.rid]
            self._finish(h, reason, error)
        self._take_new()
        while self._pending:
            self._finish(self._pending.popleft(), reason, error)

    def _finish(self, h: Handle, reason: str, error: str | None = None, text: str = "") -> None:
        h.finished = True
        if h.detok is not None and reason != "cancelled":
            text += h.detok.flush()
        if reason in FINISHED_BY_SERVER and error is None:
            error = "the request ended early"
        with self._lock:
            self._in_flight -= 1
        self.metrics.requests.labels(reason).inc()
        self._post(h, Event(text, reason, error, h.tokens))

    @staticmethod
    def _post(h: Handle, event: Event) -> None:
        try:
            h.loop.call_soon_threadsafe(h.events_q.put_nowait, event)
        except RuntimeError:  # the handler's loop has closed: nobody is waiting for this request
            pass
