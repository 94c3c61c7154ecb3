"""How a `bench --suite e2e` result reads: row names, the printed table, the machine it ran on."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch

PEERS = ("hf_", "llama_cpp")  # other projects' decoders: one configuration each


def label(r: dict) -> str:
    """A row's name in tables and plots, e.g. 'dflash compile b4 bf16 k8'."""
    name = {"hf_generate": "transformers generate", "hf_prompt_lookup": "transformers prompt lookup",
            "reference": f"reference {r['drafter']}", "ar": "AR", "llama_cpp": "llama.cpp F32",
            "llama_cpp_prompt_lookup": "llama.cpp prompt lookup F32",
            "llama_cpp_q4_1": "llama.cpp Q4_1"}.get(r["method"], r["method"])
    if r["method"].startswith(PEERS):
        return name
    dtype = {"float32": "fp32", "bfloat16": "bf16"}[r["dtype"]]
    width = f" k{r['k']}" if r["k"] is not None and r["method"] != "reference" else ""
    mode = "" if r["method"] == "reference" else f" {r['mode']}"
    return f"{name}{mode} b{r['batch']} {dtype}{width}"


def format_table(result: dict) -> str:
    """The rows as a Markdown table (pasteable into docs), then the machine line and the notes."""
    lines = ["| target | method | tau | tokens/s | TTFT ms | x HF generate | x our AR | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        hf = "-" if r["speedup_vs_hf"] is None else f"{r['speedup_vs_hf']:.2f}"
        same = f"{100 * r['identical']:.0f} %" if r["identical"] == 1.0 else f"!! {100 * r['identical']:.1f} % !!"
        lines.append(f"| {r['target']} | {label(r)} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_ms']:.1f} | {hf} | {r['speedup_vs_ar']:.2f} | {same} |")
    m = result["machine"]
    lines.append(f"\n{m['cpu']}, {m['cores']} cores, torch threads {result['settings']['threads']}; "
                 f"torch {m['torch']}, transformers {m['transformers']}; {m['date']}")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def best_width(speeds: dict) -> int | str:
    """The fastest verify width of one sweep (the only one when nothing was timed)."""
    return max(speeds, key=lambda k: speeds[k] or 0.0)


def format_widths(result: dict) -> str:
    """Decode tokens/s against the verify width k (the sweep that chose each drafted row's k)."""
    lines = ["\n| target | drafter | batch | tokens/s at k (eager, float32) | chosen k |", "|---|---|---|---|---|"]
    for target, info in result["targets"].items():
        for name, batches in info["verify_width_sweep"].items():
            for batch, speeds in batches.items():
                timed = {k: v for k, v in speeds.items() if v is not None}
                if len(speeds) > 1 and not timed:  # --every-width: each k has rows of its own
                    cells, chosen = "not swept (--every-width)", " ".join(map(str, sorted(speeds)))
                else:
                    cells = ", ".join(f"k={k}: {v:.1f}" for k, v in timed.items()) or "one k, not swept"
                    chosen = best_width(speeds)
                lines.append(f"| {target} | {name} | {batch} | {cells} | {chosen} |")
    return "\n".join(lines)


def bf16_matmul(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices natively (on CPU: oneDNN's check for AVX512-BF16/AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def read_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s, best of `repeats` sums over a `megabytes` float32 tensor at the
    current thread count: what one decode step, which reads every weight once, can at best stream."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def bytes_per_token(target: torch.nn.Module, codes: bool = True) -> int:
    """Weight bytes one batch-1 decode step reads: every parameter once, except an untied input
    embedding (a step reads one row of it); with `codes`, a weight a Runtime gave exact codes is read
    as its codes (`dflow_rt.models.exact_codes`), as our rounds read it."""
    embedding = target.embed_tokens.weight
    tied = embedding.data_ptr() == target.lm_head.weight.data_ptr()
    layers = [m for m in target.modules() if codes and getattr(m, "codes", None) is not None]
    coded = {m.weight.data_ptr(): m.codes.codes.numel() for m in layers}
    seen, total = set(), 0
    for p in target.parameters():
        if p.data_ptr() in seen or (p is embedding and not tied):
            continue
        seen.add(p.data_ptr())
        total += coded.get(p.data_ptr(), p.numel() * p.element_size())
    return total


def machine(device: torch.device) -> dict:
    """What the figures were measured on, for the JSON and the table's footer."""
    import transformers

    info = {}
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    cpu = f"{info.get('model name') or platform.processor() or platform.machine()}"
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']}, model {info.get('model')})"
    return {"cpu": cpu, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cores": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_matmul": bf16_matmul(device), "load_average": list(os.getloadavg()), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "commit": commit(),
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def commit() -> str | None:
    """The checkout's HEAD, '+dirty' when tracked files differ from it; None outside a git checkout."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.CalledProcessError):
        return None
