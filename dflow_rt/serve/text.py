"""Token ids to streamed text: what may be sent now, and where a stop string ends the answer.

A delta is sent only once it cannot change: a trailing replacement character (half of a
multi-byte character) and any tail that could still grow into a stop string wait for the next
tokens. So the streamed deltas always concatenate to the final text, which never contains the
stop string (as the OpenAI API defines `stop`).
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Text of one request as its tokens arrive (`add`), with `stops` cut off."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # decoded so far, cut at a stop string once one is found
        self.sent = 0  # characters of `text` handed out as deltas
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: Sequence[int]) -> tuple[str, int]:
        """(delta ready to send, tokens consumed): fewer tokens than given when a stop string
        ends the text inside them (then `stopped` is set and later calls add nothing)."""
        if self.stopped or not ids:
            return "", 0
        start = self.sent
        self.ids += ids
        self.text = self._decode(self.ids)
        if self._find_stop(start) >= 0:
            used = self._cut_tokens(len(ids), start)
            return self._take(len(self.text)), used
        whole = self.text.rstrip(REPLACEMENT)  # a half character waits for the rest of its bytes
        return self._take(len(whole) - self._stop_prefix_tail(whole)), len(ids)

    def flush(self) -> str:
        """Everything not yet sent: the request has ended, nothing can change the text any more."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def _find_stop(self, start: int) -> int:
        """Index in `text` where the first stop string begins (searching from `start`), or -1."""
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits, default=-1)

    def _cut_tokens(self, new: int, start: int) -> int:
        """Keep the tokens up to the one that completes the stop string and the text before it;
        returns how many of the `new` tokens that keeps."""
        base = len(self.ids) - new
        for k in range(1, new + 1):  # at most one block of tokens, once per request
            self.text = self._decode(self.ids[:base + k])
            cut = self._find_stop(start)
            if cut >= 0:
                self.ids, self.text, self.stopped = self.ids[:base + k], self.text[:cut], True
                return k
        raise AssertionError("the stop string was in the whole text")

    def _stop_prefix_tail(self, text: str) -> int:
        """Length of the longest unsent tail of `text` that is the start of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text) - self.sent), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
