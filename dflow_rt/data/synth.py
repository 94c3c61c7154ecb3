"""Generated training text: arithmetic word problems and chat exchanges about Python objects.

Everything is a pure function of its seed or of the running interpreter, so every process (and
every DDP rank) builds the same data. Held-out items are decided by a stable hash of the item's
*text identity* (the question, or the object's name), not only by seed, so no phrasing or seed
collision can put a held-out item into training.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
from dataclasses import dataclass
from functools import lru_cache, partial

from dflow_rt.tokenizer import CHAT_TEMPLATE

MATH_TRAIN_SEEDS = range(0, 1_000_000)
MATH_HELDOUT_START = 10_000_000  # held-out problems use seeds >= this (and a held-out question hash)
MATH_HELDOUT_FRACTION = 0.02
MATH_PER_EPOCH = 16_000  # plain-text word problems per pretraining epoch
MATH_CHAT_PER_EPOCH = 8_000  # chat-form word problems per pretraining epoch
CHAT_HELDOUT_FRACTION = 0.10  # of the eligible (C-implemented) objects: about 80 prompts


def stable_unit(key: str) -> float:
    """A number in [0, 1) fixed by `key` alone (unlike `hash`, the same in every process)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


# ------------------------------------------------------------------------------------------ math

NAMES = [("Alice", "she"), ("Bob", "he"), ("Carmen", "she"), ("David", "he"), ("Emma", "she"), ("Farid", "he"),
         ("Grace", "she"), ("Hiro", "he"), ("Ines", "she"), ("Jamal", "he"), ("Kira", "she"), ("Liam", "he"),
         ("Maya", "she"), ("Noah", "he"), ("Olga", "she"), ("Pedro", "he"), ("Quinn", "she"), ("Ravi", "he"),
         ("Sofia", "she"), ("Tom", "he"), ("Uma", "she"), ("Victor", "he"), ("Wen", "she"), ("Yusuf", "he")]
ITEMS = ["apples", "marbles", "books", "pencils", "stickers", "cookies", "cards", "shells", "coins", "stamps",
         "oranges", "balloons", "toy cars", "flowers", "eggs", "candies", "crayons", "buttons", "cupcakes",
         "seeds", "beads", "bottles", "kites", "puzzles"]


def _add(r, n, p, m, it):
    a, b = r.randint(2, 99), r.randint(2, 99)
    return (f"{n} has {a} {it}. {p.capitalize()} gets {b} more. How many {it} does {n} have now?",
            f"{n} starts with {a} {it} and gets {b} more, so {a} + {b} = {a + b}. The answer is {a + b}")


def _sub(r, n, p, m, it):
    a = r.randint(10, 99)
    b = r.randint(1, a - 1)
    return (f"{n} has {a} {it} and gives {b} of them to {m}. How many {it} does {n} have left?",
            f"{n} gives away {b} of {a} {it}, so {a} - {b} = {a - b}. The answer is {a - b}")


def _mul(r, n, p, m, it):
    a, b = r.randint(2, 12), r.randint(2, 20)
    return (f"{n} buys {a} bags of {it}. Each bag has {b} {it}. How many {it} does {n} buy?",
            f"There are {a} bags with {b} {it} each, so {a} * {b} = {a * b}. The answer is {a * b}")


def _together(r, n, p, m, it):
    a, b = r.randint(2, 99), r.randint(2, 99)
    return (f"{n} has {a} {it} and {m} has {b} {it}. How many {it} do they have together?",
            f"Together they have {a} + {b} = {a + b} {it}. The answer is {a + b}")


def _compare(r, n, p, m, it):
    a, b = sorted(r.sample(range(2, 100), 2), reverse=True)
    return (f"{n} has {a} {it} and {m} has {b} {it}. How many more {it} does {n} have than {m}?",
            f"{n} has {a} and {m} has {b}, so {a} - {b} = {a - b}. The answer is {a - b}")


def _share(r, n, p, m, it):
    a, b = r.randint(2, 12), r.randint(2, 12)
    return (f"{n} has {a * b} {it} and shares them equally among {b} friends. How many {it} does each friend get?",
            f"{a * b} {it} shared among {b} friends is {a * b} / {b} = {a}. The answer is {a}")


def _price(r, n, p, m, it):
    a, b = r.randint(2, 15), r.randint(2, 25)
    return (f"{n} buys {a} {it}. Each one costs {b} dollars. How many dollars does {n} pay?",
            f"{a} {it} at {b} dollars each cost {a} * {b} = {a * b} dollars. The answer is {a * b}")


def _two_step(r, n, p, m, it):
    a, b, c = r.randint(2, 50), r.randint(2, 9), r.randint(2, 12)
    d = r.randint(1, a + b * c - 1)
    t = a + b * c
    return (f"{n} has {a} {it}. {p.capitalize()} buys {b} packs with {c} {it} in each pack, then gives {d} "
            f"{it} to {m}. How many {it} does {n} have now?",
            f"The packs hold {b} * {c} = {b * c} {it}. {n} then has {a} + {b * c} = {t}. After giving away {d}, "
            f"{t} - {d} = {t - d}. The answer is {t - d}")


MATH_TEMPLATES = (_add, _sub, _mul, _together, _compare, _share, _price, _two_step)


def math_problem(seed: int) -> tuple[str, str]:
    """(question, worked answer ending with the number) for `seed`; the same on every Python >= 3.2."""
    r = random.Random(seed)
    (n, p), (m, _) = r.sample(NAMES, 2)
    return r.choice(MATH_TEMPLATES)(r, n, p, m, r.choice(ITEMS))


def math_is_heldout(question: str) -> bool:
    return stable_unit("math:" + question) < MATH_HELDOUT_FRACTION


def math_train_problems(start: int, count: int) -> list[tuple[str, str]]:
    """Problems from `count` consecutive training seeds (wrapping in the range) from `start`,
    skipping any whose question belongs to the held-out bucket."""
    seeds = (MATH_TRAIN_SEEDS.start + (start + i) % len(MATH_TRAIN_SEEDS) for i in range(count))
    return [qa for qa in map(math_problem, seeds) if not math_is_heldout(qa[0])]


@lru_cache(maxsize=8)
def heldout_math_problems(n: int) -> tuple[tuple[str, str], ...]:
    """The first `n` held-out problems: seeds >= MATH_HELDOUT_START whose question hashes held-out."""
    out, seed = [], MATH_HELDOUT_START
    while len(out) < n:
        qa = math_problem(seed)
        if math_is_heldout(qa[0]) and qa not in out:
            out.append(qa)
        seed += 1
    return tuple(out)


def math_text(question: str, answer: str) -> str:
    """The plain-text (non-chat) form of a problem used in pretraining."""
    return f"Question: {question}\nAnswer: {answer}"


# ------------------------------------------------------------------------------------------ chat

DOC_MODULES = ("builtins", "math", "cmath", "itertools", "functools", "operator", "os", "os.path", "sys", "time",
               "json", "re", "random", "string", "collections", "statistics", "textwrap", "shutil", "pathlib",
               "datetime", "heapq", "bisect", "copy", "glob", "fnmatch", "hashlib", "base64", "binascii", "struct",
               "zlib", "array", "csv", "io", "tempfile", "fractions", "decimal", "enum", "dataclasses", "inspect",
               "contextlib", "typing", "urllib.parse", "html", "difflib", "pprint", "calendar", "zipfile", "gzip",
               "threading", "subprocess", "logging", "argparse", "unicodedata", "shlex", "keyword", "weakref",
               "codecs", "types", "gc", "errno", "stat", "secrets", "uuid")
BUILTIN_TYPES = (str, bytes, bytearray, list, tuple, dict, set, frozenset, int, float, complex)
SITE_NAMES = {"exit", "quit", "copyright", "credits", "license", "help"}  # added by `site`, not always there
QUESTIONS = ("What does `{k}` do in Python?", "Explain `{k}`.", "How is `{k}` used?", "What is `{k}` for?",
             "Can you describe `{k}` from the Python standard library?", "Tell me about `{k}`.")


@dataclass(frozen=True)
class DocItem:
    key: str  # dotted name, e.g. "math.sqrt" or "str.split"
    answer: str
    compiled: bool  # implemented in C: its docstring is nowhere in the stdlib source corpus

    @property
    def heldout(self) -> bool:
        """Only C objects can be held out: a Python object's docstring is in the source corpus."""
        return self.compiled and stable_unit("chat:" + self.key) < CHAT_HELDOUT_FRACTION


def _answer(key: str, obj) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc or len(doc) < 24:
        return None
    paragraphs, text = doc.split("\n\n"), ""
    for para in paragraphs:  # whole paragraphs, about 700 characters at most
        if text and len(text) + len(para) > 700:
            break
        text += ("\n\n" if text else "") + para
    return f"`{key}{_signature(obj)}`\n\n{text}"


class _Opaque:
    def __repr__(self) -> str:
        return "..."


def _signature(obj) -> str:
    """The signature, with defaults whose repr depends on the process (addresses, live state) as `...`."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [p.replace(default=_Opaque()) if p.default is not p.empty and (
        " at 0x" in repr(p.default) or len(repr(p.default)) > 40) else p for p in sig.parameters.values()]
    text = str(sig.replace(parameters=params))
    return "" if " at 0x" in text else text


def _is_compiled(obj) -> bool:
    try:
        return inspect.getsourcefile(obj) is None
    except TypeError:
        return True


@lru_cache(maxsize=1)
def doc_items() -> tuple[DocItem, ...]:
    """One item per documented public callable of DOC_MODULES and builtin-type method, deduplicated by
    object (a re-exported object keeps its first name), in a fixed order."""
    seen, items = set(), []
    candidates = [(f"{t.__name__}.{a}", getattr(t, a)) for t in BUILTIN_TYPES for a in sorted(vars(t))
                  if not a.startswith("_")]
    for mod_name in DOC_MODULES:
        mod = importlib.import_module(mod_name)
        # A hook the host process replaced (pytest swaps sys.unraisablehook) is read from its `__x__` original.
        candidates += [(f"{mod_name}.{a}" if mod_name != "builtins" else a, getattr(mod, f"__{a}__", getattr(mod, a)))
                       for a in sorted(dir(mod)) if not a.startswith("_") and a not in SITE_NAMES]
    for key, obj in candidates:
        if not callable(obj) or inspect.ismodule(obj) or isinstance(obj, partial) or id(obj) in seen:
            continue
        seen.add(id(obj))
        answer = _answer(key, obj)
        if answer is not None:
            items.append(DocItem(key, answer, _is_compiled(obj)))
    return tuple(items)


def doc_chat(item: DocItem, phrasing: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[phrasing % len(QUESTIONS)].format(k=item.key)},
            {"role": "assistant", "content": item.answer}]


def heldout_phrasing(item: DocItem) -> int:
    return int(stable_unit("phrasing:" + item.key) * len(QUESTIONS))


def math_chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


@lru_cache(maxsize=1)
def _template():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The tokenizer's chat template rendered without a tokenizer (the tokenizer is trained on this text)."""
    return _template().render(messages=messages, add_generation_prompt=add_generation_prompt)


def chat_prompt(question: str) -> str:
    """A one-question conversation ready for the assistant's answer."""
    return render_chat([{"role": "user", "content": question}], add_generation_prompt=True)
