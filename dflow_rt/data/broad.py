"""Training prompts that look like what users ask (the "broad" mix of `train regen --mix broad`).

The project's own generators (stdlib snippets, eight word-problem templates, questions about stdlib
objects) teach a drafter those generators: tau 2.7 on their held-out items, about 1.5 on prompts
written elsewhere. This mix widens each kind while staying a pure function of (seed, index):
- code: a task from the docstring of a function in an installed package the project depends on
  (torch, transformers, sympy, networkx, jinja2, tqdm), read with `ast` (nothing is imported), as a
  signature and docstring to continue, as HumanEval's prompts are, or as a request in chat form;
- math: word problems of many kinds (rates, percentages, time, averages, areas, ages, change, unit
  prices...) in many phrasings, as chat;
- chat: requests of many kinds (explain, compare, list, advise, write an email, a story, a poem,
  summarise, plan) over about 150 everyday, school and technical topics.

No evaluation set is read here: HumanEval, MT-Bench, CHAMP and the project's held-out items stay
out (`tests/test_prompt_split.py` checks the texts and their word 10-grams).
"""

from __future__ import annotations

import ast
import importlib.util
import random
from functools import cache
from pathlib import Path

from dflow_rt.data.synth import ITEMS, NAMES

CODE_PACKAGES = ("torch", "transformers", "sympy", "networkx", "jinja2", "tqdm")


@cache
def package_files() -> tuple[tuple[str, str], ...]:
    """(package, path) of every source file of CODE_PACKAGES found here, tests left out, in a fixed order."""
    out = []
    for name in CODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        out += [(name, str(p)) for p in sorted(root.rglob("*.py")) if "test" not in p.relative_to(root).as_posix()]
    return tuple(out)


def _functions(path: str) -> list[tuple[str, str, str]]:
    """(name, arguments, docstring) of the public functions and methods in `path` with a docstring of
    40 characters or more."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError, OSError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                out.append((node.name, ast.unparse(node.args), doc))
    return out


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    return first.split(". ")[0].rstrip(".")


def code_task(r: random.Random) -> tuple[str, bool] | None:
    """(text, chat) of a code task from a random function's docstring, or None (no such function)."""
    files = package_files()
    if not files:
        return None
    functions = _functions(r.choice(files)[1])
    if not functions:
        return None
    name, args, doc = r.choice(functions)
    doc = doc.split("\n\n")[0] if len(doc) > 600 else doc
    if r.random() < 0.5:
        body = "\n".join("    " + line if line else "" for line in doc.splitlines())
        return f'def {name}({args}):\n    """{body.strip()}\n    """\n', False
    what = _summary(doc)
    what = what[0].lower() + what[1:] if what else what
    asks = (f"Write a Python function `{name}({args})` that does the following: {what}.",
            f"Implement `{name}` in Python. It {what}.",
            f"How would I write a function called {name} in Python? It should do this: {what}.",
            f"Can you show me Python code for `{name}({args})`? Docstring:\n{doc}")
    return r.choice(asks), True


# ------------------------------------------------------------------------------------------- math

def _money(r, n, p, m, it):
    price, count = r.randint(2, 40), r.randint(2, 9)
    paid = (price * count // 10 + 1) * 10
    return f"{n} buys {count} {it} at ${price} each and pays with ${paid}. How much change does {p} get?"


def _percent(r, n, p, m, it):
    total, pct = r.choice([20, 40, 50, 60, 80, 120, 200, 250, 400]), r.choice([10, 20, 25, 30, 40, 50, 75])
    return f"A store has {total} {it}. {pct}% of them are sold on Monday. How many {it} are left?"


def _rate(r, n, p, m, it):
    speed, hours = r.randint(3, 80), r.randint(2, 9)
    return f"{n} travels at {speed} miles per hour for {hours} hours. How far does {p} travel?"


def _work(r, n, p, m, it):
    per_hour, hours, days = r.randint(3, 30), r.randint(2, 8), r.randint(2, 7)
    return f"{n} makes {per_hour} {it} an hour and works {hours} hours a day. " \
           f"How many {it} does {p} make in {days} days?"


def _average(r, n, p, m, it):
    scores = [r.randint(50, 100) for _ in range(r.randint(3, 5))]
    return f"{n}'s test scores are {', '.join(map(str, scores[:-1]))} and {scores[-1]}. What is the average score?"


def _area(r, n, p, m, it):
    w, h, cost = r.randint(3, 30), r.randint(3, 30), r.randint(2, 15)
    return f"A rectangular garden is {w} meters long and {h} meters wide. Fencing costs ${cost} per meter. " \
           f"How much does it cost to fence the whole garden?"


def _age(r, n, p, m, it):
    a, d, y = r.randint(4, 40), r.randint(2, 30), r.randint(2, 15)
    return f"{n} is {a} years old. {m} is {d} years older than {n}. How old will {m} be in {y} years?"


def _time(r, n, p, m, it):
    h, mins, dur = r.randint(6, 11), r.choice([0, 15, 30, 45]), r.randint(25, 200)
    return f"A train leaves at {h}:{mins:02d} a.m. and the trip takes {dur} minutes. When does it arrive?"


def _fraction(r, n, p, m, it):
    total, a, b = r.choice([12, 24, 36, 48, 60]), r.choice([2, 3, 4]), r.choice([2, 3, 6])
    return f"{n} has {total} {it}. {p.capitalize()} gives 1/{a} of them to {m} and eats 1/{b} of the rest. " \
           f"How many {it} are left?"


def _ratio(r, n, p, m, it):
    a, b, k = r.randint(1, 5), r.randint(1, 5), r.randint(2, 12)
    return f"The ratio of {n}'s {it} to {m}'s {it} is {a}:{b}. Together they have {(a + b) * k}. " \
           f"How many does {m} have?"


def _units(r, n, p, m, it):
    km, liters = r.randint(50, 900), r.randint(4, 12)
    return f"A car uses {liters} liters of fuel per 100 km. How many liters does it need for a {km} km trip?"


def _interest(r, n, p, m, it):
    amount, rate, years = r.choice([100, 500, 1000, 2500]), r.randint(2, 9), r.randint(2, 5)
    return f"{n} puts ${amount} in a savings account with {rate}% simple interest per year. " \
           f"How much money is there after {years} years?"


MATH_KINDS = (_money, _percent, _rate, _work, _average, _area, _age, _time, _fraction, _ratio, _units, _interest)
MATH_ASKS = ("{q}", "Solve this problem: {q}", "{q} Show your work.", "Question: {q}", "Help me with my homework. {q}",
             "{q} Explain each step.", "Can you work this out? {q}", "Math problem: {q} Give the final answer.",
             "I'm stuck on this one: {q}", "{q} Think step by step.")


def math_question(r: random.Random) -> str:
    (n, p), (m, _) = r.sample(NAMES, 2)
    return r.choice(MATH_ASKS).format(q=r.choice(MATH_KINDS)(r, n, p, m, r.choice(ITEMS)))


# ------------------------------------------------------------------------------------------- chat

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "climate change", "the French Revolution", "the Roman Empire",
    "World War I", "the printing press", "vaccines", "the immune system", "sleep", "meditation", "healthy eating",
    "running a marathon", "learning a new language", "public speaking", "time management", "job interviews",
    "writing a resume", "starting a small business", "personal budgeting", "investing in index funds", "inflation",
    "supply and demand", "cryptocurrency", "electric cars", "solar panels", "recycling", "composting", "gardening",
    "houseplants", "baking bread", "making pasta", "coffee", "tea", "wine tasting", "vegetarian cooking", "camping",
    "hiking safety", "travelling in Japan", "visiting Paris", "a road trip across the United States", "packing light",
    "learning to swim", "chess", "playing the guitar", "jazz", "classical music", "film photography",
    "painting with watercolors", "writing poetry", "Shakespeare", "science fiction novels", "mythology",
    "the Olympic Games", "soccer", "basketball", "yoga", "dogs", "cats", "birds", "the ocean", "volcanoes",
    "earthquakes", "the Moon landing", "Mars exploration", "artificial intelligence", "machine learning",
    "neural networks", "the internet", "how search engines work", "computer security", "passwords", "databases",
    "cloud computing", "open source software", "version control with git", "Linux", "spreadsheets", "email etiquette",
    "remote work", "teamwork", "leadership", "negotiation", "conflict resolution", "parenting", "friendship",
    "moving to a new city", "renting an apartment", "buying a used car", "home repairs", "saving energy at home",
    "the history of money", "democracy", "human rights", "the United Nations", "ancient Egypt", "the Silk Road",
    "the Renaissance", "the Industrial Revolution", "evolution", "DNA", "the periodic table", "gravity",
    "electricity", "magnets", "rainbows", "the seasons", "weather forecasting", "dinosaurs", "bees", "forests",
    "deserts", "rivers", "mountains", "glaciers", "renewable energy", "nuclear power", "3D printing", "robots",
    "smartphones", "social media", "video games", "board games", "birthday parties", "weddings", "gift ideas",
    "writing a thank-you note", "a job offer", "a team meeting", "a customer complaint", "a product launch",
    "a school science fair", "studying for exams", "note-taking", "reading faster", "memory techniques",
    "statistics", "probability", "algebra", "geometry", "calculus", "prime numbers", "sorting algorithms",
    "recursion", "web design", "user experience", "first aid", "stress", "exercise for beginners",
    "drinking enough water", "posture", "volunteering", "museums", "architecture", "city planning", "public transport",
)
CHAT_ASKS = (
    "Explain {t} in simple terms.", "What should a beginner know about {t}?",
    "Give me five interesting facts about {t}.",
    "Write a short paragraph about {t}.", "What are the pros and cons of {t}?", "Summarize the key ideas of {t}.",
    "Write a short poem about {t}.", "Write a short story that involves {t}.", "How would you teach {t} to a child?",
    "What are common misconceptions about {t}?", "Give me some tips about {t}.", "Why does {t} matter?",
    "Write a blog post introduction about {t}.", "Create a quiz with three questions about {t}.",
    "Write a professional email to a colleague about {t}.", "Make a one-week plan to learn about {t}.",
    "Compare {t} and {u}.", "What is the connection between {t} and {u}?", "List the main steps involved in {t}.",
    "Describe the history of {t} briefly.", "What questions should I ask an expert about {t}?",
    "Write a tweet about {t}.", "Explain {t} as if I were a university student.",
    "What are three books or resources for learning about {t}?", "Write a dialogue between two friends about {t}.",
    "Give an example that illustrates {t}.", "What are the biggest challenges related to {t}?",
    "Write a haiku about {t}.", "In two sentences, what is {t}?", "How has {t} changed over the last century?",
)


def chat_question(r: random.Random) -> str:
    t, u = r.sample(TOPICS, 2)
    return r.choice(CHAT_ASKS).format(t=t, u=u)
