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

Lookup rounds (`dflow_rt.lookup`: drafts from the text's own past, where a row has them) are one
more choice with a rate of its own: a row with such drafts gets a lookup round while lookup rounds'
measured rate is at least the rate of the width the fallback would run, and every LOOKUP_RETRY-th
chance anyway (their rate moves with the text too). On SmolLM2's HumanEval prompts they emitted
about 3 tokens a round at width 4, on chat prompts 1.3-2.2, where a drafted round at width 2 pays
about as much.

While plain steps win, drafting is tried again after 16, 32, ... 512 steps (acceptance moves with
the text), and each retry is judged by its own rounds: the weak stretch that stopped drafting would
otherwise outvote a retry on easier text for a whole window of rounds. While a drafted width wins,
each of its rounds is checked against the others' last timings, and the other widths are timed
again every 256 rounds (costs grow with the context).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

FIRST_RETRY = 16  # plain steps before drafting is tried again, doubling while plain steps keep winning
LONGEST_RETRY = 512
RECHECK = 256  # rounds at a drafted width between two timings of the other widths
PROBE = 2  # rounds of each other width per probe
TIMINGS = 5  # a width's time is the median of its last few rounds: one slow round on a busy machine moves it not
MARGIN = 1.05  # between probes, another width takes over when it is this much faster (noise moves rates by less)
WINDOW = 32  # drafted rounds whose tokens are averaged (one round's is too noisy to act on)
LOOKUP_RETRY = 32  # chances of a lookup round passed up before one is run to time them again


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
        """The measured width of the highest rate (the current one while nothing else is measured)."""
        rates = {j: r for j in self.widths if (r := self.rate(j)) is not None}
        return max(rates, key=rates.get) if rates else self.current


class ArFallback:
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

    def record(self, rows: int, width: int, seconds: float, tokens: Sequence[float]) -> None:
        """A round of bucket `rows` at `width` took `seconds` (host time, device work included) and
        emitted `tokens` to each live row."""
        b = self.buckets[rows]
        if width > 1:
            b.rounds.append((width, tuple(tokens)))
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
        if b.left <= 0:  # the widest first: its rounds also show what the narrower ones would emit
            b.probes = [j for j in reversed(b.widths) if j != b.current for _ in range(PROBE)]
            if b.current == 1:  # a retry is judged by its own rounds, not by the stretch that stopped drafting
                b.rounds.clear()

    def lookup(self, rows: int, width: int) -> bool:
        """Whether bucket `rows`, whose rows have lookup drafts, runs a lookup round instead of one at
        `width`: while too few are timed, while their rate is at least that width's (unmeasured: yes),
        and every LOOKUP_RETRY-th chance."""
        b = self.buckets[rows]
        other = b.rate(width)
        b.passed += 1
        if len(b.lookups) < PROBE or other is None or b.passed >= LOOKUP_RETRY:
            b.passed = 0
            return True
        tokens = statistics.mean(t for _, t in b.lookups)
        if tokens / statistics.median(s for s, _ in b.lookups) >= other:
            b.passed = 0
            return True
        return False

    def record_lookup(self, rows: int, seconds: float, tokens: Sequence[float]) -> None:
        """A lookup round of bucket `rows` took `seconds` and emitted `tokens` to each live row."""
        self.buckets[rows].lookups.append((seconds, statistics.mean(tokens)))

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
