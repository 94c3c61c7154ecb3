"""A short soak of the bundled models: churn, cancellations and bad requests for 300 rounds, with
every finished request exactly as expected and nothing left behind (`dflow-rt soak` runs 10,000)."""

import pytest

import dflow_rt
from dflow_rt.bench.soak import Soak, run_soak
from dflow_rt.models.bundled import drafter_dir, target_dir
from dflow_rt.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def bundled():
    target = dflow_rt.load_target(target_dir(None))
    return target, dflow_rt.load_drafter(drafter_dir("dflash"), target), load_tokenizer(target_dir(None))


def test_soak_300_rounds(bundled):
    soak = Soak(rounds=300, mode="eager", max_batch=4, max_len=256, prompts=6, max_new=(8, 24, 48))
    result = run_soak(*bundled, soak, progress=False)
    assert result["requests"] > 30 and result["cancelled"] > 0 and result["bad"] > 30
    assert result["exact_fraction"] == 1.0 and result["failed"] == 0, result["mismatches"]
    assert result["bad_refused_fraction"] == 1.0
    assert result["leaked_records"] == 0 and result["free_rows"] == 4
    assert result["recompiles"] == 0
    assert result["rss_growth"] < 0.05, result
    assert min(result["rounds_per_s_by_tenth"]) > 0
