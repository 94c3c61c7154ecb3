"""bench/gpu_run.sh dry-run on CPU at tiny sizes: the stages a GPU run has, on the bundled target, each
recorded in gpu_run.json, and drafters that come back whole and load."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import dflow_rt
from dflow_rt.models.bundled import target_dir

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_script_runs_every_stage_at_tiny_sizes(tmp_path):
    out, stage = tmp_path / "out", tmp_path / "stage"
    env = {**os.environ, "DEVICE": "cpu", "TARGET": str(target_dir(None)), "PROMPTS": "6", "NEW": "12",
           "REGEN_BATCH": "3", "STEPS": "2", "BATCH": "2", "EVAL_SEQS": "2", "LIMIT": "2", "EVAL_NEW": "8",
           "OUT": str(out), "STAGE": str(stage),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # its python3 is this one
    done = subprocess.run(["bash", "bench/gpu_run.sh", "run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_run.json").read_text())
    stages = ["regen", "dflash_base", "dflow", "dflash", "tau_dflash", "tau_dflow", "tau_dflow_relay_off"]
    assert {k: v["status"] for k, v in report["stages"].items()} == dict.fromkeys(stages, "ok")
    for name in ("tau_dflash", "tau_dflow", "tau_dflow_relay_off"):
        assert set(report[name]["suites"]) == {"code", "mt-bench", "champ"}
        assert all(s["prompts"] == 2 and s["tau"] >= 1 for s in report[name]["suites"].values())
    assert report["tau_dflow"]["relay"] and not report["tau_dflow_relay_off"]["relay"]
    assert [e["event"] for e in report["training"]["dflow"]][-1] == "end"
    target = dflow_rt.load_target(target_dir(None))
    for name in ("dflash", "dflow"):
        whole = tmp_path / f"{name}.tar"
        whole.write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob(f"{name}.tar.*"))))
        with tarfile.open(whole) as tar:
            tar.extractall(tmp_path / name, filter="data")
        drafter = dflow_rt.load_drafter(tmp_path / name, target)
        assert drafter.block_size == 16 and (drafter.relay is not None) == (name == "dflow")
