"""`dflow-rt bench --suite serve`: a bounded load test of `dflow-rt serve` on loopback.

For each drafter (the default one, then none), a server runs in a subprocess (as in production:
its engine thread does not share an interpreter with the clients), and clients of the official
`openai` package send `--requests` streamed requests between them: completions of HumanEval
prompts and chat turns of MT-Bench questions (`--kinds`), at each of `--temperatures`. Arrivals
are closed-loop (`--clients` clients, each sending its next request when one ends) or, with
`--rate R`, a Poisson stream of R requests a second (at most `--clients` in flight), so requests
join running ones throughout. With `--llama-server PATH` (llama.cpp's own server binary) and
`--gguf FILE ...`, that server runs each file under the same load, as peer rows, with
`--clients` parallel slots and continuous batching.

Reported per row: throughput (requests and output tokens per second), time to first token and
inter-token latency p50/p99, time per output token, the server process's peak resident memory,
greedy answers that differ from the same server's answer to the prompt sent alone (a token lost
or misrouted shows here: 0 expected of dflow-rt, whose greedy rows do not depend on their batch),
and from dflow-rt's /metrics its mean step time without and with a prefill in it, the share of
steps that prefilled, rows per step and tau. A streamed chunk carries one round's tokens, so
inter-token latency is the gap between chunks: what a client sees between updates. Its p99 is
also given relative to the decode-only step time (goal: within 2x while requests keep joining).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflow_rt.errors import DflowError

KINDS = ("completion", "chat")


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    """Flags of `bench --suite serve` beyond the bench's own (--target, --drafter, --modes, --threads,
    --max-new-tokens, --prompts, --json)."""
    p.add_argument("--clients", type=int, default=16,
                   help="serve: concurrent clients (at most this many requests in flight), the server's "
                        "--max-batch and llama.cpp's parallel slots [16]")
    p.add_argument("--requests", type=int, default=64, help="serve: requests per row, all clients together [64]")
    p.add_argument("--max-prefill-tokens", type=int, default=None, help="serve: the server's flag [its default]")
    p.add_argument("--max-len", type=int, default=None, help="serve: the server's flag [its default]")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=["completion"],
                   help="serve: completions of HumanEval prompts and/or chat turns of MT-Bench questions [completion]")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0], help="serve: a set of rows each [0]")
    p.add_argument("--rate", type=float, default=None,
                   help="serve: Poisson arrivals, requests a second, at most --clients in flight [closed loop]")
    p.add_argument("--llama-server", default=None, help="serve: llama.cpp's server binary, for peer rows [none]")
    p.add_argument("--gguf", nargs="*", default=[], help="serve: model files llama.cpp's server runs, a row each")


@dataclass
class Record:
    """One request as its client saw it."""

    prompt: int  # which prompt (index into the load's prompts, wrapped), also the request's seed
    start: float
    stamps: list[float] = field(default_factory=list)  # arrival of each chunk with text
    tokens: int = 0
    text: str = ""
    error: str | None = None


@dataclass
class Load:
    """What the clients send: `requests` streamed requests of `kind` at `temperature` over `prompts`
    in turn, closed-loop from `clients` clients, or at `rate` a second with at most `clients` in flight."""

    kind: str
    prompts: list[str]
    temperature: float
    clients: int
    requests: int
    max_tokens: int
    rate: float | None = None


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan when there are no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    i = q * (len(s) - 1)
    lo = int(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


async def send(client, model: str, load: Load, rec: Record) -> None:
    """One streamed request; its chunks' arrival times, text and token count go to `rec`."""
    import openai

    common = {"model": model, "max_tokens": load.max_tokens, "temperature": load.temperature, "stream": True,
              "stream_options": {"include_usage": True}, "seed": rec.prompt}
    text = load.prompts[rec.prompt % len(load.prompts)]
    try:
        if load.kind == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": text}], **common)
        else:
            stream = await client.completions.create(prompt=text, **common)
        chunks = 0
        async for chunk in stream:
            choice = chunk.choices[0] if chunk.choices else None
            piece = None if choice is None else choice.delta.content if load.kind == "chat" else choice.text
            if piece:
                rec.stamps.append(time.perf_counter())
                rec.text += piece
                chunks += 1
            if chunk.usage is not None:
                rec.tokens = chunk.usage.completion_tokens
        rec.tokens = rec.tokens or chunks  # a server that reports no usage: a token a chunk
    except openai.OpenAIError as err:
        rec.error = f"{type(err).__name__}: {err}"


async def run_load(url: str, model: str, load: Load) -> tuple[list[Record], float]:
    """(records, wall seconds) of `load` against the server at `url`."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=600.0)
    records: list[Record] = []

    async def one(i: int) -> None:
        rec = Record(i, time.perf_counter())
        records.append(rec)
        await send(client, model, load, rec)

    t0 = time.perf_counter()
    if load.rate is None:
        todo = list(range(load.requests))[::-1]

        async def worker() -> None:
            while todo:
                await one(todo.pop())

        await asyncio.gather(*(worker() for _ in range(load.clients)))
    else:
        slots, gaps, tasks = asyncio.Semaphore(load.clients), random.Random(0), []

        async def arrive(i: int) -> None:
            async with slots:
                await one(i)

        for i in range(load.requests):
            tasks.append(asyncio.create_task(arrive(i)))
            await asyncio.sleep(gaps.expovariate(load.rate))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    await client.close()
    return records, wall


def summarize(records: list[Record], wall: float, alone: dict[int, str] | None) -> dict:
    """Client-side figures of one row; `alone`: each prompt's greedy answer sent by itself, which the
    row's answers are compared with (None for sampled rows)."""
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
            "differ_from_alone": None if alone is None else sum(r.text != alone[r.prompt % len(alone)] for r in ok),
            "first_error": next((r.error for r in records if r.error), None)}


def server_totals(url: str) -> dict[str, float]:
    """Sums and counts of dflow-rt's step-time (by prefill or not), rows-per-step and tokens-per-round
    histograms, keyed by sample name (with the prefill label appended); {} from another server."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
        families = list(text_string_to_metric_families(text))
    except (OSError, ValueError):
        return {}
    out = {}
    for fam in families:
        for s in fam.samples:
            if s.name.endswith(("_sum", "_count")) and fam.name in ("dflow_step_seconds", "dflow_step_rows",
                                                                      "dflow_tokens_per_round"):
                key = s.name + (f":{s.labels['prefill']}" if "prefill" in s.labels else "")
                out[key] = s.value
    return out


def server_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """Server figures over the measured run alone (the warm-up taken out): mean step time with and
    without a prefill in it, share of steps that prefilled, live rows per step, tau."""
    if not after:
        return {}

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


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident memory so far (VmHWM), MB; None off Linux."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dflow_server(args: argparse.Namespace, drafter: str, mode: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "dflow_rt", "serve", "--port", str(port), "--drafter", drafter,
           "--mode", mode, "--max-batch", str(args.clients), "--max-queue", str(args.requests),
           "--log-level", "warning"]
    for flag, value in (("--target", args.target), ("--threads", args.threads), ("--device", args.device),
                        ("--max-prefill-tokens", args.max_prefill_tokens), ("--max-len", args.max_len)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def llama_server(args: argparse.Namespace, gguf: str, port: int, context: int) -> list[str]:
    """llama.cpp's server on `gguf`: --clients slots of `context` positions each, continuous batching."""
    return [args.llama_server, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-np", str(args.clients),
            "-c", str(context * args.clients), "-cb", "-t", str(args.threads or 2), "--log-disable"]


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 600.0) -> str:
    """The served model's name once /v1/models answers (compile modes take minutes to build)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DflowError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/models", timeout=5) as r:
                return json.loads(r.read())["data"][0]["id"]
        except (OSError, KeyError, IndexError, ValueError):
            time.sleep(0.5)
    raise DflowError(f"the server was not ready after {timeout_s:.0f} s")


def measure(cmd: list[str], loads: list[Load]) -> list[dict]:
    """Start the server `cmd` (its port after --port), and run each load after a warm-up; a row each."""
    port = cmd[cmd.index("--port") + 1]
    url = f"http://127.0.0.1:{port}/v1"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    rows = []
    try:
        model = wait_ready(proc, url)
        for load in loads:
            warm = Load(load.kind, load.prompts, 0.0, 1, len(load.prompts), load.max_tokens)  # each prompt alone
            records, _ = asyncio.run(run_load(url, model, warm))
            alone = {r.prompt: r.text for r in records} if load.temperature == 0 else None
            before = server_totals(url)
            records, wall = asyncio.run(run_load(url, model, load))
            row = {"kind": load.kind, "temperature": load.temperature, **summarize(records, wall, alone),
                   **server_figures(before, server_totals(url)), "peak_rss_mb": peak_rss_mb(proc.pid)}
            step = row.get("decode_step_ms")
            row["itl_p99_over_step"] = round(row["itl_p99_ms"] / step, 2) if step and step == step else None
            rows.append(row)
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def run_serve_bench(args: argparse.Namespace) -> dict:
    """Benchmark each drafter's server (and llama.cpp's server on each --gguf), print the table, write --json."""
    import torch

    from dflow_rt.bench.report import machine
    from dflow_rt.data import public
    from dflow_rt.data.prompts import humaneval_prompts

    if args.clients < 1 or args.requests < 1 or (args.rate is not None and args.rate <= 0):
        raise DflowError("--clients and --requests must be >= 1, --rate > 0")
    if args.gguf and not args.llama_server:
        raise DflowError("--gguf needs --llama-server, the llama.cpp server binary that runs them")
    drafters = list(dict.fromkeys([args.drafter or ("dflash" if args.target is None else "none"), "none"]))
    mode = (args.modes or ["eager"])[0]
    count = max(args.prompts, 8)
    prompts = {"completion": humaneval_prompts()[:count], "chat": list(public.questions("mt-bench"))[:count]}
    loads = [Load(kind, prompts[kind], t, args.clients, args.requests, args.max_new_tokens, args.rate)
             for kind in args.kinds for t in args.temperatures]
    settings = {"clients": args.clients, "requests": args.requests, "max_tokens": args.max_new_tokens,
                "prompts": count, "mode": mode, "target": args.target or "bundled", "threads": args.threads,
                "max_prefill_tokens": args.max_prefill_tokens, "max_len": args.max_len, "rate": args.rate,
                "arrivals": "closed loop" if args.rate is None else f"Poisson, {args.rate} a second"}
    servers = [(f"dflow-rt, {d}", dflow_server(args, d, mode, free_port())) for d in drafters]
    context = args.max_len or 2048  # each llama.cpp slot: as dflow-rt's rows (its default --max-len)
    servers += [(f"llama.cpp {Path(g).name}", llama_server(args, g, free_port(), context)) for g in args.gguf]
    rows = []
    for name, cmd in servers:
        rows += [{"server": name, **row} for row in measure(cmd, loads)]
    result = {"suite": "serve", "machine": machine(torch.device(args.device or "cpu")), "settings": settings,
              "rows": rows}
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def format_table(result: dict) -> str:
    s = result["settings"]
    cols = [("server", "server"), ("kind", "kind"), ("T", "temperature"), ("tokens/s", "tokens_per_s"),
            ("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("ITL p50", "itl_p50_ms"),
            ("ITL p99", "itl_p99_ms"), ("decode step", "decode_step_ms"), ("prefill step", "prefill_step_ms"),
            ("prefill share", "prefill_steps"), ("ITL p99 / decode step", "itl_p99_over_step"), ("tau", "tau"),
            ("peak RSS MB", "peak_rss_mb"), ("differ from alone", "differ_from_alone"), ("errors", "errors")]
    lines = [f"serve: {s['clients']} clients, {s['requests']} requests a row, {s['arrivals']}, max_tokens "
             f"{s['max_tokens']}, {s['target']} target, {s['mode']} mode (times in ms)",
             "| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in result["rows"]:
        lines.append("| " + " | ".join(str(r.get(k, "")) for _, k in cols) + " |")
    m = result["machine"]
    lines.append(f"{m['cpu']}, {m['cores']} cores, load average {m['load_average'][0]:.2f}, {m['date']}")
    first = next((r["first_error"] for r in result["rows"] if r.get("first_error")), None)
    if first:
        lines.append(f"first error: {first}")
    return "\n".join(lines)
