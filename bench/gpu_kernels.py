"""GPU figures for the kernels: each fused op against the torch sequence it replaces, and whole
rounds per kernel implementation. CUDA only; writes OUT_DIR/gpu_kernels.json.

1. commit (accept + bonus + emitted tokens + carry + relay write): torch vs the one Triton launch,
   batch 1 / 4 / 8, B = 16, CUDA-event timing of 200 calls (target: Triton >= 3x torch);
2. attention (drafter: bidirectional block, verify: causal) over a 2,048-position cache: torch SDPA
   with a dense mask vs Triton vs FlashInfer (where `import flashinfer` works), bf16;
3. whole rounds: a Runtime (cudagraph) on random models of hidden 256 (head_dim 64) in bf16, with
   kernels = torch / triton / auto (FlashInfer attention where installed): decode tokens/s over 100
   steps at batch 1 and 4, and the tokens of every implementation equal to torch's.

Each part records its error instead of stopping the others; the JSON is rewritten after each part.

Usage: PYTHONPATH=. python bench/gpu_kernels.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import dflow_rt
from dflow_rt.config import RuntimeConfig
from dflow_rt.engine.runtime import Runtime
from dflow_rt.kernels import selection
from dflow_rt.kernels.attention import attention_torch, attention_triton
from dflow_rt.kernels.commit import commit_torch, commit_triton
from dflow_rt.models.init_random import init_random


def cuda_ms(fn: Callable[[], object], calls: int = 200) -> float:
    """Mean of `calls` launches after 20 warm-up calls, by CUDA events (ms per call)."""
    for _ in range(20):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def commit_state(rows: int, B: int = 16, features: int = 1152) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(rows)
    block = torch.randint(0, 4, (rows, B), device="cuda", generator=g)
    verified = torch.randint(0, 4, (rows, B), device="cuda", generator=g)
    long = lambda: torch.zeros(rows, dtype=torch.long, device="cuda")  # noqa: E731
    state = (torch.randn(rows, B, features, device="cuda", dtype=torch.bfloat16), long(), long(), long(),
             torch.ones(rows, dtype=torch.bool, device="cuda"), torch.ones(rows, dtype=torch.bool, device="cuda"),
             torch.zeros(rows, B + 2, dtype=torch.long, device="cuda"))
    relay = (torch.zeros(rows, B, features, device="cuda", dtype=torch.bfloat16), long(), long(), long(), long())
    return (block, verified, *state, *relay)


def part_commit() -> dict:
    out = {}
    for rows in (1, 4, 8):
        args = commit_state(rows)
        torch_ms, triton_ms = cuda_ms(lambda a=args: commit_torch(*a)), cuda_ms(lambda a=args: commit_triton(*a))
        out[f"batch {rows}"] = {"torch_ms": round(torch_ms, 4), "triton_ms": round(triton_ms, 4),
                                "speedup": round(torch_ms / triton_ms, 2)}
    return out


def part_attention() -> dict:
    b, kv, group, B, L, d = 4, 4, 4, 16, 2048, 64
    q = torch.randn(b, kv * group, B, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, kv, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    start = torch.tensor([100, 700, 1500, L - B], device="cuda")
    out = {}
    for causal in (False, True):
        row = {"torch_ms": cuda_ms(lambda c=causal: attention_torch(q, k, v, start, c)),
               "triton_ms": cuda_ms(lambda c=causal: attention_triton(q, k, v, start, c))}
        ref = attention_torch(q, k, v, start, causal).float()
        row["triton_max_diff"] = (attention_triton(q, k, v, start, causal).float() - ref).abs().max().item()
        if selection.importable("flashinfer"):
            fi = selection.load("attention", "flashinfer")
            fi.configure(causal, kv * group, kv, d, torch.bfloat16)
            fi.plan(b, L, start.tolist(), {causal: B}, torch.device("cuda"))
            row["flashinfer_ms"] = cuda_ms(lambda c=causal, f=fi: f(q, k, v, start, c))
            row["flashinfer_max_diff"] = (fi(q, k, v, start, causal).float() - ref).abs().max().item()
        out["verify (causal)" if causal else "drafter (block)"] = {key: round(x, 5) for key, x in row.items()}
    return out


def part_rounds() -> dict:
    target_dir, drafter_dir = init_random(tempfile.mkdtemp(prefix="dflow-gpu-"), hidden=256)
    target = dflow_rt.load_target(target_dir, device="cuda", dtype=torch.bfloat16)
    drafter = dflow_rt.load_drafter(drafter_dir, target)
    prompts = [[(7 * i + j) % 250 for j in range(64)] for i in range(4)]
    out, tokens = {}, {}
    for kernels in ("torch", "triton", "auto"):
        rt = Runtime(target, drafter, RuntimeConfig(max_batch=4, max_len=512, mode="cudagraph", kernels=kernels))
        entry = {"implementations": dict(rt.plan.kernels.implementations)}
        for batch in (1, 4):
            rids = [rt.add_request(p, max_new_tokens=400) for p in prompts[:batch]]
            for _ in range(5):
                rt.step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            emitted = sum(len(t) for _ in range(100) for t in rt.step().values())
            end.record()
            torch.cuda.synchronize()
            entry[f"batch {batch} tokens_per_s"] = round(emitted / (start.elapsed_time(end) / 1000), 1)
            for rid in rids:
                rt.cancel(rid)
                tokens[kernels, batch, rid - rids[0]] = rt.pop(rid).emitted
        out[kernels] = entry
    out["tokens_equal_torch"] = all(tokens[k, b, i] == tokens["torch", b, i] for k, b, i in tokens)
    return out


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "flashinfer": selection.importable("flashinfer")}
    for name, part in (("commit", part_commit), ("attention", part_attention), ("rounds", part_rounds)):
        try:
            report[name] = part()
        except Exception:  # one part's failure must not hide the others' figures
            report[name] = {"error": traceback.format_exc(limit=4)}
        (out_dir / "gpu_kernels.json").write_text(json.dumps(report, indent=2))
        print(name, json.dumps(report[name]), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_kernels"))
