"""When drafting does not pay, the target steps alone: per batch bucket, the host chooses between
the drafted round and a plain step (verify width 1, no draft pass) from the rounds' own timings.

A drafted round emits tau tokens a row in the time of a round, a plain step one token in the time
of a step. Both are measured, not modelled: a weak drafter for this text, a drafted graph that is
slow on this machine, or a busy machine all show up as tokens per second. Every round is lossless,
so the choice moves the speed and nothing else. While plain steps win, drafting is tried again
after 16, 32, ... 512 steps (acceptance moves with the text), and each retry is judged by its own
rounds: the weak stretch that stopped drafting would otherwise outvote a retry on easier text for
a whole window of rounds, and the retries back off meanwhile. While drafting wins, every drafted
round is checked against the last plain timing, and a plain step is timed again every 256 rounds
(both costs grow with the context).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

FIRST_RETRY = 16  # plain steps before drafting is tried again, doubling while plain steps keep winning
LONGEST_RETRY = 512
RECHECK = 256  # drafted rounds between two timings of a plain step
PROBE = 2  # rounds of the other kind per probe
SMOOTHING = 0.5  # weight of a new timing: a probe's two rounds outweigh what was measured before it
WINDOW = 16  # drafted rounds whose acceptance is averaged (one round's is too noisy to act on)


@dataclass
class _Bucket:
    seconds: dict[bool, float] = field(default_factory=dict)  # smoothed round time: drafted (True) or plain
    tokens: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # a row's tokens, last drafted rounds
    drafting: bool = True  # the kind that runs between probes
    left: int = 3  # rounds of that kind before the next probe
    interval: int = FIRST_RETRY
    probing: int = 0  # rounds of the other kind still to run


class ArFallback:
    """The choice of `Runtime.step()`: `drafted(rows)` before a round, `record(...)` after it."""

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def drafted(self, rows: int) -> bool:
        """Whether the next round of batch bucket `rows` drafts (else the target steps alone)."""
        b = self.buckets.setdefault(rows, _Bucket())
        return b.drafting != (b.probing > 0)

    def record(self, rows: int, drafted: bool, seconds: float, tokens_per_row: float) -> None:
        """A round of bucket `rows` took `seconds` (host time, device work included) and emitted
        `tokens_per_row` a live row."""
        b = self.buckets.setdefault(rows, _Bucket())
        if drafted:
            b.tokens.append(tokens_per_row)
        b.seconds[drafted] = _smooth(b.seconds.get(drafted), seconds)
        if b.probing:
            b.probing -= 1
            if not b.probing:
                self._decide(b)
            return
        if drafted and False in b.seconds and not _pays(b):  # acceptance fell: no probe needed to see it
            b.drafting, b.left, b.interval = False, FIRST_RETRY, FIRST_RETRY
            return
        b.left -= 1
        if b.left <= 0:
            b.probing = PROBE
            if not b.drafting:  # a retry is judged by its own rounds, not by the stretch that stopped drafting
                b.tokens.clear()

    def _decide(self, b: _Bucket) -> None:
        pays = _pays(b)
        if pays != b.drafting:
            b.drafting, b.interval = pays, FIRST_RETRY
        elif not pays:
            b.interval = min(2 * b.interval, LONGEST_RETRY)
        b.left = b.interval if not b.drafting else RECHECK


def _pays(b: _Bucket) -> bool:
    if not b.tokens or len(b.seconds) < 2:  # not both measured yet: draft
        return True
    tau = sum(b.tokens) / len(b.tokens)
    return tau * b.seconds[False] >= b.seconds[True]  # tau tokens / drafted s >= 1 token / plain s


def _smooth(before: float | None, value: float) -> float:
    return value if before is None else (1 - SMOOTHING) * before + SMOOTHING * value
