"""Lookup drafts: where the last few tokens of a request occurred before in its prompt or output,
the tokens that followed them then are a draft of what follows now.

Code repeats its own names and lines; a drafter trained on little data does not. A round that
verifies such drafts costs no draft pass, only the wider verify; where a row's text offers a
continuation, the Runtime runs one while such rounds decode faster than the width the fallback chose
(`Runtime._step`, `RoundPolicy.lookup`). Like every round it is lossless: the target checks each
draft. The index is host-side: one dict per request, updated with the tokens each round emits.
"""

from __future__ import annotations

from collections.abc import Iterable

N = 3  # tokens matched: 2 matched more often and drafted worse on HumanEval, 4 too rarely on math and chat


class NgramIndex:
    """The latest continuation of every N tokens of one request's text."""

    def __init__(self, tokens: Iterable[int], n: int = N) -> None:
        self.n, self.tokens, self.after = n, [], {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            if len(self.tokens) > self.n:  # the N tokens before this one now have a continuation
                self.after[tuple(self.tokens[-self.n - 1:-1])] = len(self.tokens) - 1

    def drafts(self, count: int) -> list[int]:
        """Up to `count` tokens that followed the text's last N tokens where they last occurred
        before (none where they did not)."""
        at = self.after.get(tuple(self.tokens[-self.n:])) if len(self.tokens) >= self.n else None
        return [] if at is None else self.tokens[at:at + count]
