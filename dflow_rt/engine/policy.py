"""Which verify width a round runs, per batch bucket: the host chooses from the rounds' own timings
among the widths the bucket has rounds for, where width 1 is a plain step (the target alone, no
draft pass).

A round at width w emits t tokens a row (1 to w) in the time of a round. Both are measured, not
modelled: a weak drafter for this text, a drafted graph that is slow on this machine, or a busy
machine all show up as tokens per second. A round at width w also shows what a narrower width j
would have emitted, min(t, j) (the drafts are the same; only fewer are checked), so a width's
expected tokens are the mean of min(t, j) over the recent rounds at widths >= j, and running the
widest width loses no information. Every round is lossless, so the choice moves the speed and
nothing else.

Lookup rounds (`dflow_rt.engine.lookup`: drafts from the text's own past, where a row has them) are one
more choice with a rate of its own: a row with such drafts gets a lookup round while lookup rounds'
measured rate is at least the rate of the width the fallback would run, and every LOOKUP_RETRY-th
chance anyway (their rate moves with the text too). On SmolLM2's HumanEval prompts they emitted
about 3 tokens a round at width 4, on chat prompts 1.3-2.2, where a drafted round at width 2 pays
about as much.

While plain steps win, drafting is tried again after 16, 32, ... 512 steps (acceptance moves with
the text), at the narrowest drafted width, the cheapest test of whether drafting pays at all (once
it does, the wider widths are timed at the next probe), and each retry is judged by its own rounds:
the weak stretch that stopped drafting would otherwise outvote a retry on easier text for a whole
window of rounds. While a drafted width wins,
each of its rounds is checked against the others' last timings, and the other widths are timed
again every 256 rounds (costs grow with the context).

What a policy learned is worth keeping: a process that answers one 64-token request would spend
most of its rounds learning what the last process already knew (a weak drafter's widest rounds
first, then probes). `state()` and `restore()` carry it over; the Runtime keeps it on disk per
machine, models and settings (`TimingsFile`), so a later start runs the width that won before.
Greedy and sampled rounds get a policy each (their acceptance differs).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dflow_rt.graphs import compile_cache
from dflow_rt.kernels.cpu import ops as cpu_ops

FIRST_RETRY = 16  # plain steps before drafting is tried again, doubling while plain steps keep winning
LONGEST_RETRY = 512
RECHECK = 256  # rounds at a drafted width between two timings of the other widths
PROBE = 2  # rounds of each other width per probe
TIMINGS = 9  # a width's time is the median of its last few rounds: a few slow ones on a busy machine move it not
UNTIMED = 3  # a new Runtime's first rounds (cold caches, weights still faulting in) are counted but not timed
MARGIN = 1.05  # between probes, another width takes over when it is this much faster (noise moves rates by less)
WINDOW = 32  # drafted rounds whose tokens are averaged (one round's is too noisy to act on)
LOOKUP_RETRY = 32  # chances of a lookup round passed up before one is run to time them again (doubling)


@dataclass
class _Bucket:
    widths: tuple[int, ...]  # the widths this bucket has rounds for, ascending
    seconds: dict[int, deque] = field(default_factory=dict)  # the last TIMINGS round times per width
    rounds: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (width, tokens of each row), drafted
    current: int = 0  # the width that runs between probes (0: not set, the widest)
    left: int = 3  # rounds of it before the next probe
    interval: int = FIRST_RETRY
    probes: list[int] = field(default_factory=list)  # widths still to run before the next decision
    lookups: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (seconds, tokens a row) of lookup rounds
    passed: int = 0  # chances of a lookup round since the last one taken
    lookup_interval: int = LOOKUP_RETRY  # chances passed up before the next retry of lookup rounds

    def tokens(self, j: int) -> float | None:
        """Expected tokens a row of a round at width j, from the recent rounds wide enough to show
        it; None when none is."""
        if j == 1:
            return 1.0
        seen = [min(t, j) for w, ts in self.rounds if w >= j for t in ts]
        return sum(seen) / len(seen) if seen else None

    def rate(self, j: int) -> float | None:
        """Tokens a row per second at width j; None until both its tokens and its time are measured."""
        tokens, seconds = self.tokens(j), self.seconds.get(j)
        return None if tokens is None or not seconds else tokens / statistics.median(seconds)

    def best(self) -> int:
        """The measured width of the highest rate (the current one while nothing else is measured); plain
        steps unless a drafted width beats them by MARGIN: a near tie is noise, and a plain step never loses
        to `--drafter none`."""
        rates = {j: r for j in self.widths if (r := self.rate(j)) is not None}
        if not rates:
            return self.current
        top = max(rates, key=rates.get)
        return 1 if top != 1 and 1 in rates and rates[top] < MARGIN * rates[1] else top


class RoundPolicy:
    """The choice of `Runtime.step()`: `width(rows)` before a round, `record(...)` after it.
    `widths` maps each batch bucket to the verify widths it has rounds for (1 among them)."""

    def __init__(self, widths: dict[int, Sequence[int]]) -> None:
        self.buckets = {n: _Bucket(tuple(sorted(set(ws)))) for n, ws in widths.items()}
        for b in self.buckets.values():
            b.current = b.widths[-1]

    def width(self, rows: int) -> int:
        """The verify width of the next round of batch bucket `rows` (1: the target steps alone)."""
        b = self.buckets[rows]
        return b.probes[0] if b.probes else b.current

    def record(self, rows: int, width: int, seconds: float | None, tokens: Sequence[float]) -> None:
        """A round of bucket `rows` at `width` took `seconds` (host time, device work included; None:
        not timed) and emitted `tokens` to each live row."""
        b = self.buckets[rows]
        if width > 1:
            b.rounds.append((width, tuple(tokens)))
        if seconds is not None:
            b.seconds.setdefault(width, deque(maxlen=TIMINGS)).append(seconds)
        if b.probes:
            b.probes.pop(0)
            if not b.probes:
                self._decide(b)
            return
        if b.current > 1:  # acceptance fell: no probe needed to see it (plain steps wait for the retry)
            now, best = b.rate(b.current), b.best()
            if now is not None and best != b.current and b.rate(best) > MARGIN * now:
                self._switch(b, best)
                return
        b.left -= 1
        if b.left <= 0 and b.current == 1:  # a retry: the cheapest drafted width asks whether drafting pays at
            b.probes = [b.widths[1]] * PROBE  # all (the wider ones are timed once it does), judged by its own
            b.rounds.clear()  # rounds, not by the stretch that stopped drafting
        elif b.left <= 0:  # the widest first: its rounds also show what the narrower ones would emit
            b.probes = [j for j in reversed(b.widths) if j != b.current for _ in range(PROBE)]

    def lookup(self, rows: int, width: int) -> bool:
        """Whether bucket `rows`, whose rows have lookup drafts, runs a lookup round instead of one at
        `width`: while too few are timed, while their rate is at least that width's (unmeasured: yes),
        and as a retry after LOOKUP_RETRY chances passed up, then twice as many while they keep losing
        (up to LONGEST_RETRY), as drafting is retried."""
        b = self.buckets[rows]
        other = b.rate(width)
        b.passed += 1
        if len(b.lookups) < PROBE or other is None:
            b.passed = 0
            return True
        tokens = statistics.mean(t for _, t in b.lookups)
        if tokens / statistics.median(s for s, _ in b.lookups) >= other:
            b.passed, b.lookup_interval = 0, LOOKUP_RETRY
            return True
        if b.passed >= b.lookup_interval:
            b.passed, b.lookup_interval = 0, min(2 * b.lookup_interval, LONGEST_RETRY)
            return True
        return False

    def record_lookup(self, rows: int, seconds: float | None, tokens: Sequence[float]) -> None:
        """A lookup round of bucket `rows` took `seconds` (None: not timed, not kept) and emitted `tokens`
        to each live row."""
        if seconds is not None:
            self.buckets[rows].lookups.append((seconds, statistics.mean(tokens)))

    def state(self) -> dict:
        """What the policy has learned, as plain JSON values (`restore` reads it back)."""
        return {str(n): {"widths": list(b.widths), "current": b.current, "left": b.left, "interval": b.interval,
                         "seconds": {str(w): list(v) for w, v in b.seconds.items()},
                         "rounds": [[w, list(t)] for w, t in b.rounds], "lookups": [list(x) for x in b.lookups],
                         "passed": b.passed, "lookup_interval": b.lookup_interval} for n, b in self.buckets.items()}

    def restore(self, state: dict) -> None:
        """Carry on from `state()` of a policy over the same buckets and widths; a bucket whose widths
        differ, or an entry that does not parse, is left as a new policy starts it."""
        for n, b in self.buckets.items():
            saved = state.get(str(n))
            try:
                if saved is None or tuple(saved["widths"]) != b.widths or saved["current"] not in b.widths:
                    continue
                seconds = {int(w): deque(map(float, v), maxlen=TIMINGS) for w, v in saved["seconds"].items()}
                rounds = deque(((int(w), tuple(map(float, t))) for w, t in saved["rounds"]), maxlen=WINDOW)
                lookups = deque(((float(x), float(t)) for x, t in saved["lookups"]), maxlen=WINDOW)
                current, left, interval = int(saved["current"]), int(saved["left"]), int(saved["interval"])
                passed, lookup_interval = int(saved["passed"]), int(saved["lookup_interval"])
            except (KeyError, TypeError, ValueError):
                continue
            b.seconds, b.rounds, b.lookups, b.probes = seconds, rounds, lookups, []
            b.current, b.left, b.passed = current, max(left, 1), passed
            b.lookup_interval = min(max(lookup_interval, LOOKUP_RETRY), LONGEST_RETRY)
            b.interval = min(max(interval, FIRST_RETRY), LONGEST_RETRY)

    def _decide(self, b: _Bucket) -> None:
        best = b.best()
        if best != b.current:
            self._switch(b, best)
            return
        if best == 1:
            b.interval = min(2 * b.interval, LONGEST_RETRY)
        b.left = b.interval if best == 1 else RECHECK

    @staticmethod
    def _switch(b: _Bucket, width: int) -> None:
        b.current, b.interval = width, FIRST_RETRY
        b.left = FIRST_RETRY if width == 1 else RECHECK


class TimingsFile:
    """The policies' state on disk, one JSON file per key (machine, models, settings; the Runtime's),
    under `$DFLOW_RT_CACHE/timings/`. Written after a request ends, at most every SAVE_EVERY seconds
    (and always the first time), through a temporary file renamed into place, so a reader never
    sees half a file; a file that cannot be read or written is ignored (the policy learns anew)."""

    SAVE_EVERY = 5.0

    def __init__(self, key: str) -> None:
        self.path = self.directory() / f"{key}.json"
        self.saved_at: float | None = None

    @classmethod
    def of(cls, target, drafter, plan) -> TimingsFile:
        """The file of these models (their values too: another drafter accepts otherwise) and these
        rounds (`plan`), on this machine and thread count (`compile_cache.entry_key`)."""
        values = hashlib.sha256()
        for m in (target, drafter):
            for module in m.modules() if m is not None else ():
                codes = getattr(module, "codes", None)  # a weight held as codes has no float32 values to read
                if codes is not None:
                    values.update(codes.codes.reshape(-1)[:64].cpu().numpy().tobytes())
                for p in module.parameters(recurse=False):
                    if not cpu_ops.held(p):
                        values.update(p.detach().reshape(-1)[:16].float().cpu().numpy().tobytes())
        settings = {**plan.graph_settings(), "buckets": plan.buckets, "widths": plan.widths,
                    "values": values.hexdigest()[:16]}
        return cls(compile_cache.entry_key(target, drafter, settings)[0])

    @staticmethod
    def directory() -> Path:
        from dflow_rt.paths import cache_root

        return cache_root() / "timings"

    def load(self) -> dict:
        try:
            state = json.loads(self.path.read_text())
            return state if isinstance(state, dict) else {}
        except (OSError, ValueError):
            return {}

    def save(self, state: dict, force: bool = False) -> None:
        now = time.monotonic()
        if not force and self.saved_at is not None and now - self.saved_at < self.SAVE_EVERY:
            return
        self.saved_at = now
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump(state, f)
            Path(tmp).replace(self.path)
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
