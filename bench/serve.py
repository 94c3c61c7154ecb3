"""`dflow-rt bench --suite serve`: a bounded load test of `dflow-rt serve` on loopback.

For each drafter (the default one, then none), a server runs in a subprocess (as in production:
its engine thread does not share an interpreter with the clients), and `--clients` concurrent
clients of the official `openai` package send `--requests` streamed greedy completions of
HumanEval prompts between them, each client starting its next request when one ends. Reported:
throughput (requests and tokens per second), time to first token and inter-token latency
p50/p99, time per output token, and from the server's /metrics its mean step time without and
with a prefill in it, the share of steps that prefilled, rows per step and tau. A streamed chunk
carries one round's tokens, so inter-token latency is the gap between chunks: what a client sees
between updates. Its p99 is also given relative to the decode-only step time (target: within 2x
at batch 16); a prefill stalls the running streams for as long as it takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from dflow_rt.errors import DflowError


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    """Flags of `bench --suite serve` beyond the bench's own (--target, --drafter, --modes, --threads,
    --max-new-tokens, --prompts, --json)."""
    p.add_argument("--clients", type=int, default=16,
                   help="serve: concurrent clients, and the server's --max-batch; the first max(--prompts, --clients) "
                        "HumanEval prompts are sent [16]")
    p.add_argument("--requests", type=int, default=64, help="serve: requests per server, all clients together [64]")
    p.add_argument("--max-prefill-tokens", type=int, default=None, help="serve: the server's flag [its default]")


@dataclass
class Record:
    """One request as its client saw it."""

    start: float
    stamps: list[float] = field(default_factory=list)  # arrival of each chunk with text
    tokens: int = 0
    error: str | None = None


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan when there are no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    i = q * (len(s) - 1)
    lo = int(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


async def load(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int):
    """(records, wall seconds) of `requests` streamed completions from `clients` concurrent clients."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=600.0)
    todo = list(range(requests))[::-1]
    records: list[Record] = []

    async def worker() -> None:
        while todo:
            i = todo.pop()
            rec = Record(time.perf_counter())
            records.append(rec)
            try:
                stream = await client.completions.create(model=model, prompt=prompts[i % len(prompts)],
                                                         max_tokens=max_tokens, temperature=0.0, stream=True,
                                                         stream_options={"include_usage": True})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        rec.stamps.append(time.perf_counter())
                    if chunk.usage is not None:
                        rec.tokens = chunk.usage.completion_tokens
            except openai.OpenAIError as err:
                rec.error = f"{type(err).__name__}: {err}"

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return records, wall


def summarize(records: list[Record], wall: float) -> dict:
    ok = [r for r in records if r.error is None and r.stamps]
    ttft = [r.stamps[0] - r.start for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.stamps, r.stamps[1:], strict=False)]
    tpot = [(r.stamps[-1] - r.stamps[0]) / (r.tokens - 1) for r in ok if r.tokens > 1 and len(r.stamps) > 1]
    ms = 1000.0
    return {"requests": len(records), "errors": len(records) - len(ok), "wall_s": round(wall, 3),
            "requests_per_s": round(len(ok) / wall, 3), "tokens_per_s": round(sum(r.tokens for r in ok) / wall, 1),
            "ttft_p50_ms": round(pct(ttft, 0.5) * ms, 1), "ttft_p99_ms": round(pct(ttft, 0.99) * ms, 1),
            "itl_p50_ms": round(pct(itl, 0.5) * ms, 1), "itl_p99_ms": round(pct(itl, 0.99) * ms, 1),
            "tpot_mean_ms": round(statistics.fmean(tpot) * ms, 1) if tpot else float("nan"),
            "first_error": next((r.error for r in records if r.error), None)}


def server_totals(url: str) -> dict[str, float]:
    """Sums and counts of the server's step-time (by prefill or not), rows-per-step and tokens-per-round
    histograms, keyed by sample name (with the prefill label appended)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_sum", "_count")) and fam.name in ("dflow_step_seconds", "dflow_step_rows",
                                                                      "dflow_tokens_per_round"):
                key = s.name + (f":{s.labels['prefill']}" if "prefill" in s.labels else "")
                out[key] = s.value
    return out


def server_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """Server figures over the measured run alone (the warm-up taken out): mean step time with and
    without a prefill in it, share of steps that prefilled, live rows per step, tau."""
    def diff(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def mean(name: str, *labels: str) -> float:
        tail = [f":{label}" for label in labels] or [""]
        count = sum(diff(f"{name}_count{t}") for t in tail)
        return sum(diff(f"{name}_sum{t}") for t in tail) / count if count else float("nan")

    steps = diff("dflow_step_seconds_count:yes") + diff("dflow_step_seconds_count:no")
    return {"step_mean_ms": round(mean("dflow_step_seconds", "yes", "no") * 1000, 2),
            "decode_step_ms": round(mean("dflow_step_seconds", "no") * 1000, 2),
            "prefill_step_ms": round(mean("dflow_step_seconds", "yes") * 1000, 2),
            "prefill_steps": round(diff("dflow_step_seconds_count:yes") / steps, 3) if steps else None,
            "rows_mean": round(mean("dflow_step_rows"), 2), "tau": round(mean("dflow_tokens_per_round"), 3),
            "steps": int(steps)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, drafter: str, mode: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflow_rt", "serve", "--port", str(port), "--drafter", drafter,
           "--mode", mode, "--max-batch", str(args.clients), "--max-queue", str(args.requests),
           "--log-level", "warning"]
    for flag, value in (("--target", args.target), ("--threads", args.threads), ("--device", args.device),
                        ("--max-prefill-tokens", args.max_prefill_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    return subprocess.Popen(cmd)


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 600.0) -> str:
    """The served model's name once /health answers (compile modes take minutes to build)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DflowError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/models", timeout=5) as r:
                return json.loads(r.read())["data"][0]["id"]
        except OSError:
            time.sleep(0.5)
    raise DflowError(f"the server was not ready after {timeout_s:.0f} s")


def run_serve_bench(args: argparse.Namespace) -> dict:
    """Benchmark each drafter's server, print the table, write --json."""
    import torch

    from dflow_rt.bench.report import machine
    from dflow_rt.data.prompts import suite_texts

    if args.clients < 1 or args.requests < 1:
        raise DflowError("--clients and --requests must be >= 1")
    drafters = list(dict.fromkeys([args.drafter or ("dflash" if args.target is None else "none"), "none"]))
    mode = (args.modes or ["eager"])[0]
    prompts = suite_texts("code", max(args.prompts, args.clients))
    settings = {"clients": args.clients, "requests": args.requests, "max_tokens": args.max_new_tokens,
                "prompts": len(prompts), "mode": mode, "target": args.target or "bundled",
                "threads": args.threads, "max_prefill_tokens": args.max_prefill_tokens,
                "sampling": "greedy, streamed, HumanEval prompts"}
    rows = []
    for drafter in drafters:
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        proc = start_server(args, drafter, mode, port)
        try:
            model = wait_ready(proc, url)
            asyncio.run(load(url, model, prompts, min(args.clients, 2), min(args.requests, 2), 8))  # warm-up
            before = server_totals(url)
            records, wall = asyncio.run(load(url, model, prompts, args.clients, args.requests, args.max_new_tokens))
            after = server_totals(url)
        finally:
            proc.terminate()
            proc.wait(60)
        row = {"drafter": drafter, **summarize(records, wall), **server_figures(before, after)}
        step = row["decode_step_ms"]
        row["itl_p99_over_step"] = round(row["itl_p99_ms"] / step, 2) if step == step and step > 0 else None
        rows.append(row)
    result = {"suite": "serve", "machine": machine(torch.device(args.device or "cpu")), "settings": settings,
              "rows": rows}
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def format_table(result: dict) -> str:
    s = result["settings"]
    cols = [("drafter", "drafter"), ("tokens/s", "tokens_per_s"), ("req/s", "requests_per_s"),
            ("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("ITL p50", "itl_p50_ms"),
            ("ITL p99", "itl_p99_ms"), ("TPOT", "tpot_mean_ms"), ("decode step", "decode_step_ms"),
            ("prefill step", "prefill_step_ms"), ("prefill share", "prefill_steps"), ("rows", "rows_mean"),
            ("ITL p99 / decode step", "itl_p99_over_step"), ("tau", "tau"), ("errors", "errors")]
    lines = [f"serve: {s['clients']} clients, {s['requests']} requests, max_tokens {s['max_tokens']}, "
             f"{s['target']} target, {s['mode']} mode (times in ms)",
             "| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in result["rows"]:
        lines.append("| " + " | ".join(str(r.get(k)) for _, k in cols) + " |")
    m = result["machine"]
    lines.append(f"{m['cpu']}, {m['cores']} cores, load average {m['load_average'][0]:.2f}, {m['date']}")
    first = next((r["first_error"] for r in result["rows"] if r.get("first_error")), None)
    if first:
        lines.append(f"first error: {first}")
    return "\n".join(lines)
