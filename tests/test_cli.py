import json
import subprocess
import sys

import pytest

import dflow_rt
import dflow_rt.oracle
from dflow_rt.commands.main import main


@pytest.fixture(scope="module")
def demo_models(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert main(["init-random", str(out)]) == 0
    return out / "target", out / "drafter"


def run_json(capsys, *argv):
    assert main(["generate", *argv, "--mode", "eager", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_is_lossless_and_complete(demo_models, capsys):
    target_dir, drafter_dir = demo_models
    spec = run_json(capsys, "--target", str(target_dir), "--drafter", str(drafter_dir), "--prompt", "def f(x):",
                    "--max-new-tokens", "24")
    plain = run_json(capsys, "--target", str(target_dir), "--prompt", "def f(x):", "--max-new-tokens", "24")
    assert {"text", "token_ids", "acceptance_lengths", "tau", "tokens_per_s"} <= spec.keys()
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert plain["acceptance_lengths"] == [1] * (len(plain["token_ids"]) - 1)
    target = dflow_rt.load_target(target_dir)
    expected = dflow_rt.oracle.generate(target, None, spec["prompt_ids"], max_new_tokens=24).token_ids
    assert spec["token_ids"] == expected
    drafted = len(spec["acceptance_lengths"]) - spec["plain_steps"] - spec["lookup_rounds"]  # tau: drafted rounds
    emitted = sum(spec["acceptance_lengths"]) - spec["plain_steps"] - spec["lookup_tokens"]
    assert drafted > 0 and spec["tau"] == pytest.approx(emitted / drafted, abs=1e-3)


def test_generate_verify_width(capsys):
    """--verify-width K: the bundled pair's rounds emit at most K tokens (K - 1 drafts and the bonus),
    the tokens stay the target's own greedy ones."""
    args = ["--chat", "--prompt", "Victor has 82 buttons. He gets 47 more. How many buttons does Victor have now?",
            "--max-new-tokens", "40"]
    full, narrow = run_json(capsys, *args, "--verify-width", "16"), run_json(capsys, *args, "--verify-width", "2")
    assert narrow["token_ids"] == full["token_ids"] and max(full["acceptance_lengths"]) > 2
    assert max(narrow["acceptance_lengths"]) == 2
    assert len(narrow["acceptance_lengths"]) > len(full["acceptance_lengths"])


def test_generate_takes_the_autotune_knobs_and_flags_win(capsys, tmp_path, monkeypatch):
    """The file `dflow-rt autotune` writes for these models on this device applies without a flag, with
    one line on stderr: its dtype, threads and verify width (tokens stay the target's greedy ones);
    --verify-width beats it, --no-tuned ignores it; with no file, --tuned says so, and the per-device
    defaults apply."""
    from dflow_rt.config import DEVICE_DEFAULTS
    from dflow_rt.engine.tuned import device_name, entry_key, store
    from dflow_rt.models.bundled import drafter_dir, target_dir

    monkeypatch.setenv("DFLOW_RT_CONFIG", str(tmp_path))
    width = DEVICE_DEFAULTS["cpu", "float32"]["verify_width"]
    args = ["--chat", "--prompt", "Victor has 82 buttons. He gets 47 more. How many buttons does Victor have now?",
            "--max-new-tokens", "40", "--mode", "eager"]

    def generate(*extra):
        assert main(["generate", *args, *extra, "--json"]) == 0
        out, err = capsys.readouterr()
        return json.loads(out), err

    default, err = generate("--tuned")
    assert "runtime defaults" in err and default["verify_width"] == width and default["dtype"] == "float32"
    assert max(default["acceptance_lengths"]) == width and generate()[1] == ""  # no file, no flag: silent
    assert default["ar_fallback"] and default["rounds"] == len(default["acceptance_lengths"]) >= default["plain_steps"]
    plain, _ = generate("--no-ar-fallback")
    assert plain["token_ids"] == default["token_ids"] and not plain["ar_fallback"] and plain["plain_steps"] == 0
    assert default["lookup"] and not plain["lookup"] and plain["lookup_rounds"] == 0  # lookup rounds: with the fallback
    unlooked, _ = generate("--no-lookup")
    assert unlooked["token_ids"] == default["token_ids"] and unlooked["ar_fallback"] and not unlooked["lookup"]
    assert unlooked["lookup_rounds"] == 0

    def write(dtype: str) -> None:
        knobs = {"threads": 1, "mode": "eager", "length_step": None, "buckets": {"1": {"verify_width": 3}}}
        store({"dtype": dtype, "knobs": {dtype: knobs}}, entry_key(target_dir(None), drafter_dir("dflash")),
              device_name("cpu"))

    write("float32")
    tuned, err = generate()
    assert str(tmp_path / "tuned") in err and "verify width {1: 3}" in err and len(err.splitlines()) == 1
    assert tuned["token_ids"] == default["token_ids"] and max(tuned["acceptance_lengths"]) == 3
    assert tuned["verify_width"] == {"1": 3} and tuned["threads"] == 1
    flagged, _ = generate("--verify-width", "2")
    assert flagged["token_ids"] == default["token_ids"] and max(flagged["acceptance_lengths"]) == 2
    assert not flagged["ar_fallback"] and tuned["ar_fallback"]  # a width given is kept; a tuned one is not given
    ignored, err = generate("--no-tuned")
    assert err == "" and ignored["verify_width"] == width
    write("bfloat16")
    assert generate("--tuned")[0]["dtype"] == "bfloat16"
    fp32, err = generate("--tuned", "--dtype", "float32")  # the file holds bf16 knobs only
    assert "runtime defaults" in err and fp32["dtype"] == "float32" and fp32["verify_width"] == width
    assert fp32["token_ids"] == default["token_ids"]


def test_generate_text_and_chat(demo_models, capsys):
    target_dir, drafter_dir = demo_models
    assert main(["generate", "--target", str(target_dir), "--drafter", str(drafter_dir), "--prompt", "hello",
                 "--max-new-tokens", "8", "--block-size", "4", "--chat", "--mode", "eager"]) == 0
    out = capsys.readouterr().out
    assert "tau" in out and "tokens/s" in out and "rounds" in out
    chat = run_json(capsys, "--target", str(target_dir), "--prompt", "hello", "--chat", "--max-new-tokens", "4")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    assert tok.decode(chat["prompt_ids"]) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_errors_are_one_line(demo_models, tmp_path):
    target_dir, _ = demo_models
    cases = [
        ["--target", str(tmp_path / "nope"), "--prompt", "x"],
        ["--target", str(target_dir), "--prompt", "x", "--max-new-tokens", "100000"],
        ["--target", str(target_dir), "--drafter", str(target_dir), "--prompt", "x"],
    ]
    for argv in cases:
        proc = subprocess.run([sys.executable, "-m", "dflow_rt", "generate", *argv], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("dflow-rt: error: ")
