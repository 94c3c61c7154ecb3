"""GPU check for the static runtime (run on a lent CUDA machine; writes JSON to $OUT or argv[1]).

1. cudagraph and compile backends emit exactly the eager round's tokens (greedy) on the
   reference fixture pair;
2. with `cudagraph`, `torch.cuda.memory_stats()["allocation.all.allocated"]` does not move
   across 100 `step()` calls after warm-up;
3. `dflow-rt bench --suite runtime` figures for eager / compile / cudagraph, batch 1 and 4.

Usage: PYTHONPATH=. python bench/gpu_runtime_check.py OUT_DIR
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

import dflow_rt
from dflow_rt.bench.runtime import bench_runtime, format_table
from dflow_rt.config import RuntimeConfig
from dflow_rt.runtime import Runtime

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "dflash_reference"


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    target = dflow_rt.load_target(FIXTURES / "target", dtype=torch.float32, device="cuda")
    drafter = dflow_rt.load_drafter(FIXTURES / "drafter", target)
    cases = json.loads((FIXTURES / "rounds.json").read_text())["cases"]
    prompts = [c["prompt_ids"] for c in cases]
    outputs = {}
    for backend in ("eager", "compile", "cudagraph"):
        t = time.perf_counter()
        rt = Runtime(target, drafter, RuntimeConfig(max_batch=4, max_len=256, backend=backend))
        outputs[backend] = rt.generate(prompts, max_new_tokens=64)
        report[f"{backend}_build_and_generate_s"] = time.perf_counter() - t
    report["tokens_match_reference"] = {b: o == [c["output_ids"] for c in cases] for b, o in outputs.items()}

    rt = Runtime(target, drafter, RuntimeConfig(max_batch=4, max_len=4096, backend="cudagraph"))
    for p in prompts[:4]:
        rt.add_request(p, max_new_tokens=3000)
    for _ in range(5):
        rt.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(100):
        rt.step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    report["allocations_over_100_steps"] = after - before

    bench = bench_runtime(target, drafter, [p[:32] for p in prompts], ["eager", "compile", "cudagraph"], [1, 4], 50)
    report["bench"] = bench
    print(format_table(bench))
    print(json.dumps({k: v for k, v in report.items() if k != "bench"}, indent=2))
    (out_dir / "gpu_runtime_check.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "gpu_out")))
