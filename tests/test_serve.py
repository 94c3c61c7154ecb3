"""`dflow-rt serve` through the official `openai` client, against live servers on loopback.

One server runs in a thread of this process over the bundled pair (eager, batch 16), so tests can
reach its engine; a second one runs as `dflow-rt serve` in a subprocess (batch 2, queue 1) for the
queue-full, hang-up and SIGTERM paths. Expected texts come from a batch-1 Runtime holding only
that request (and once from `dflow-rt generate`).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dflow_rt.config import RuntimeConfig
from dflow_rt.data.prompts import chat_text, suite_texts
from dflow_rt.engine.runtime import Runtime
from dflow_rt.models.bundled import load_models
from dflow_rt.serve.app import create_app
from dflow_rt.serve.engine import Engine, Params
from dflow_rt.tokenizer import stop_token_ids
from tests.helpers import fixed

MAX_LEN = 384
MODEL = "bundled"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(base: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_for(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def subprocess_server(tmp_path_factory):
    """`dflow-rt serve` with 2 rows and a queue of 1, started first so that it boots during the other tests."""
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "stderr.txt"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dflow_rt", "serve", "--port", str(port), "--max-batch",
                                 "2", "--max-queue", "1", "--max-len", "512", "--mode", "eager", "--log-level",
                                 "warning", "--shutdown-grace", "0.5"], stdout=subprocess.DEVNULL, stderr=err)
    proc.log = log
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


@pytest.fixture(scope="module", autouse=True)
def _boot_subprocess_early(subprocess_server):
    yield


@pytest.fixture(scope="module")
def pair():
    target, drafter, tokenizer = load_models(None, "dflash")
    return target, drafter, tokenizer


@pytest.fixture(scope="module")
def alone(pair):
    """Text (and token count) of a request with nothing else in a batch-1 Runtime, as the server decodes it."""
    target, drafter, tokenizer = pair
    rt = Runtime(target, drafter, fixed(max_batch=1, max_len=MAX_LEN))
    stops = stop_token_ids(tokenizer)

    def run(prompt: str, max_tokens: int, **kw) -> tuple[str, list[int]]:
        ids = rt.generate([tokenizer.encode(prompt, add_special_tokens=False)], max_new_tokens=max_tokens,
                          stop_token_ids=stops, **kw)[0]
        return tokenizer.decode(ids, skip_special_tokens=True), ids

    return run


def in_process(app) -> tuple[str, uvicorn.Server, threading.Thread]:
    """`app` served on a free loopback port from a thread: (base URL, server, thread), once it listens."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: srv.started, 30, "the server to start")
    return f"http://127.0.0.1:{sock.getsockname()[1]}", srv, thread


@pytest.fixture(scope="module")
def server(pair):
    """The in-process server: (base URL, engine, openai client)."""
    target, drafter, tokenizer = pair
    engine = Engine(Runtime(target, drafter, fixed(max_batch=16, max_len=MAX_LEN)), tokenizer, max_queue=16,
                    stop_token_ids=stop_token_ids(tokenizer))
    base, srv, thread = in_process(create_app(engine, MODEL, 1.0))
    client = openai.OpenAI(base_url=base + "/v1", api_key="test", max_retries=0, timeout=60)
    yield base, engine, client
    srv.should_exit = True
    thread.join(15)
    assert not engine.alive() and not thread.is_alive()


def stream_text(stream) -> tuple[str, str | None, int | None]:
    """(joined text deltas, finish reason, completion tokens from usage) of a streamed completion."""
    text, finish, tokens = [], None, None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text if hasattr(choice, "text") else choice.delta.content or "")
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), finish, tokens


def test_dflow_rt_and_its_command_line_import_without_the_serve_packages():
    code = ("import sys\n"
            "for name in ('fastapi', 'uvicorn', 'sse_starlette', 'starlette', 'openai', 'prometheus_client'):\n"
            "    sys.modules[name] = None\n"
            "import dflow_rt, dflow_rt.commands.main\n"
            "args = dflow_rt.commands.main.parser().parse_args(['serve', '--port', '0'])\n"
            "assert args.max_batch == 16\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("stops", [(), ("\n",), ("END",), ("ld 😀 o",), ("zz", "ne E")])
def test_streamed_text_holds_back_half_characters_and_stop_prefixes(pair, stops):
    from dflow_rt.serve.text import Detokenizer

    tokenizer = pair[2]
    text = "héllo wörld 😀 ok\nnext line END here"
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = min((text.index(s) for s in stops if s in text), default=len(text))
    for size in (1, 3, 16):
        detok, deltas, used = Detokenizer(tokenizer, stops), [], 0
        for i in range(0, len(ids), size):
            delta, n = detok.add(ids[i:i + size])
            assert "\ufffd" not in delta
            deltas.append(delta)
            used += n
        deltas.append(detok.flush())
        assert "".join(deltas) == detok.text == text[:cut]
        assert detok.stopped == (cut < len(text)) and used == len(detok.ids)
        if detok.stopped:  # the tokens kept end with the one that completed the stop string
            assert any(s in tokenizer.decode(detok.ids) for s in stops)
            assert not any(s in tokenizer.decode(detok.ids[:-1]) for s in stops)


def test_greedy_completion_is_the_cli_text_and_the_stream_adds_up_to_it(server, alone, pair, capsys):
    from dflow_rt.commands.main import main

    _, _, client = server
    prompt = "def fibonacci(n):"
    expected, ids = alone(prompt, 40)
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", "40", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert whole.choices[0].text == expected and whole.object == "text_completion"
    assert whole.usage.completion_tokens == len(ids)
    assert whole.usage.prompt_tokens == len(pair[2].encode(prompt, add_special_tokens=False))
    assert whole.choices[0].finish_reason == ("length" if len(ids) == 40 else "stop")
    text, finish, tokens = stream_text(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert (text, finish, tokens) == (expected, whole.choices[0].finish_reason, len(ids))


def test_sixteen_concurrent_streams_each_get_their_own_text(server, alone):
    base, engine, client = server
    prompts = [t[-120:] for t in suite_texts("code", 16)]
    assert len(set(prompts)) == 16
    expected = [alone(p, 24) for p in prompts]
    steps, before = engine.steps, metrics(base)

    def one(prompt: str):
        return stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts))
    for (text, _, tokens), (want, ids) in zip(got, expected, strict=True):
        assert text == want and tokens == len(ids)
    after = metrics(base)
    wide = [after[k] - before.get(k, 0.0) for k in [("dflow_step_rows_count", ()), ("dflow_step_rows_bucket",
                                                                                     (("le", "8.0"),))]]
    assert engine.steps - steps < 24 * 4 and wide[0] > wide[1]  # they shared steps: some ran more than 8 rows
    assert engine.rt.requests == {} and engine.running() == 0


def test_sampling_fields_and_stops_map_onto_the_runtime(server, alone):
    _, _, client = server
    prompt = "import os\n\n\ndef main():\n"
    want, _ = alone(prompt, 30, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.8, top_p=0.9, seed=7,
                                    extra_body={"top_k": 20})
    assert got.choices[0].text == want
    greedy, ids = alone(prompt, 30)
    assert "\n" in greedy.strip("\n")
    stop = greedy.strip("\n").split("\n")[0][-3:]  # a stop string ending the first non-empty line
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == greedy[:greedy.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < len(ids)
    streamed, finish, _ = stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30,
                                                                temperature=0, stop=stop, stream=True))
    assert (streamed, finish) == (cut.choices[0].text, "stop")
    by_id = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                      extra_body={"stop_token_ids": [ids[5]]})
    assert by_id.usage.completion_tokens == ids.index(ids[5]) + 1 and by_id.choices[0].finish_reason == "stop"


def test_chat_uses_the_chat_template(server, alone, pair):
    _, _, client = server
    question = "What does os.path.join do?"
    want, ids = alone(chat_text(pair[2], question), 32)
    messages = [{"role": "user", "content": question}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens == len(ids) and got.object == "chat.completion"
    text, finish, _ = stream_text(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                                                 temperature=0, stream=True))
    assert text == want and finish == got.choices[0].finish_reason


@pytest.mark.parametrize("fields, param", [
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"temperature": -1.0}, "temperature"),
    ({"logprobs": 3}, None),
    ({"prompt": "x " * 2000}, "prompt"),
    ({"max_tokens": MAX_LEN}, "max_tokens"),
    ({"prompt": [5, 99999]}, "prompt"),
])
def test_bad_requests_get_400_with_an_openai_error(server, fields, param):
    _, _, client = server
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**{"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, **fields})
    body = err.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert body["param"] == param and body["message"]


def test_malformed_body_wrong_model_and_the_side_routes(server):
    base, _, client = server
    request = urllib.request.Request(base + "/v1/completions", data=b'{"model": "bundled", "prompt": ',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 400 and "malformed JSON" in json.loads(err.value.read())["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert json.loads(urllib.request.urlopen(base + "/health", timeout=10).read())["status"] == "ok"
    names = {name for name, _ in metrics(base)}
    assert {"dflow_requests_total", "dflow_generation_tokens_total", "dflow_tokens_per_round_bucket",
            "dflow_queue_depth", "dflow_step_seconds_sum", "dflow_rejected_requests_total"} <= names


def test_hang_ups_are_cancelled_within_one_step(server):
    base, engine, client = server
    before = metrics(base).get(("dflow_requests_total", (("finish_reason", "cancelled"),)), 0.0)
    stream = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=300, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    wait_for(lambda: engine.running() == 0 and engine.in_flight() == 0, what="the streamed request's row to be freed")
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=10)  # a non-streamed one hangs up too
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "import", "max_tokens": 300}),
                 {"Content-Type": "application/json"})
    wait_for(lambda: engine.running() == 1, what="the second request to start")
    conn.close()
    wait_for(lambda: engine.running() == 0 and engine.in_flight() == 0, what="the second request's row to be freed")
    m = metrics(base)
    assert m[("dflow_requests_total", (("finish_reason", "cancelled"),))] == before + 2
    assert m[("dflow_cancel_lag_steps_bucket", (("le", "1.0"),))] == m[("dflow_cancel_lag_steps_count", ())] >= 2
    assert engine.rt.requests == {}


def test_a_fault_in_one_request_ends_it_alone(server, alone, pair):
    _, _, client = server
    target = pair[0]
    bad_prompt = list(range(100, 137))  # 37 tokens: no other prefill or round has this many positions

    def poison(module, inputs, out):
        return out.fill_(float("nan")) if out.shape[1] == len(bad_prompt) else out

    good = "class Stack:\n"
    want, _ = alone(good, 24)
    hook = target.model.layers[1].register_forward_hook(poison)
    try:
        with ThreadPoolExecutor(3) as pool:
            ok = pool.submit(lambda: client.completions.create(model=MODEL, prompt=good, max_tokens=24, temperature=0))
            whole = pool.submit(lambda: client.completions.create(model=MODEL, prompt=bad_prompt, max_tokens=24))
            streamed = pool.submit(lambda: stream_text(client.completions.create(
                model=MODEL, prompt=bad_prompt, max_tokens=24, stream=True)))
            assert ok.result().choices[0].text == want
            with pytest.raises(openai.InternalServerError, match="NaN"):
                whole.result()
            with pytest.raises(openai.APIError, match="NaN"):
                streamed.result()
    finally:
        hook.remove()
    assert client.completions.create(model=MODEL, prompt=good, max_tokens=24, temperature=0).choices[0].text == want


def _subprocess_client(subprocess_server) -> tuple[subprocess.Popen, str, openai.OpenAI]:
    proc, base = subprocess_server
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.log.read_text()
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            break
        except OSError:
            assert time.monotonic() < deadline, "dflow-rt serve did not come up"
            time.sleep(0.2)
    return proc, base, openai.OpenAI(base_url=base + "/v1", api_key="test", max_retries=0, timeout=60)


def test_a_full_queue_gets_429_and_hung_up_streams_free_their_rows(subprocess_server):
    _, base, client = _subprocess_client(subprocess_server)
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=400, temperature=0, stream=True)
               for p in ("def f(x):", "import os", "class A:")]  # 2 rows and 1 waiting: the server is full
    firsts = [iter(s) for s in streams[:2]]
    for it in firsts:
        next(it)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert err.value.response.headers["retry-after"] == "1" and err.value.body["code"] == "queue_full"
    for s in streams:
        s.close()

    def settled() -> bool:
        m = metrics(base)
        return m[("dflow_running_requests", ())] == 0 and m[("dflow_queue_depth", ())] == 0
    wait_for(settled, what="the hung-up rows to be freed")
    m = metrics(base)
    assert m[("dflow_requests_total", (("finish_reason", "cancelled"),))] == 3
    assert m[("dflow_cancel_lag_steps_bucket", (("le", "1.0"),))] == m[("dflow_cancel_lag_steps_count", ())]
    assert m[("dflow_rejected_requests_total", (("status", "429"),))] == 1


def test_sigterm_finishes_short_requests_cancels_long_ones_and_exits_cleanly(subprocess_server):
    proc, base, client = _subprocess_client(subprocess_server)
    long = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=470, temperature=0, stream=True)
    it = iter(long)
    next(it)
    short = client.completions.create(model=MODEL, prompt="import os", max_tokens=8, temperature=0, stream=True)
    proc.send_signal(signal.SIGTERM)
    text, finish, _ = stream_text(short)
    assert finish in ("length", "stop") and text
    with pytest.raises(openai.APIError, match="shut down"):
        for _ in it:
            pass
    assert proc.wait(20) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(base + "/health", timeout=2)


def test_plain_target_steps_are_served(pair, alone):
    """The fallback's plain steps (here forced every other round) through the engine: the answer is the
    one a Runtime without the fallback gives, and the per-round metrics see every round."""
    target, drafter, tokenizer = pair
    rt = Runtime(target, drafter, RuntimeConfig(max_batch=2, max_len=MAX_LEN, mode="eager", verify_width=None,
                                                ar_fallback=True))
    rounds = iter(range(10**6))
    rt.policy.width = lambda rows: rt.plan.widths[rows] if next(rounds) % 2 else 1
    engine = Engine(rt, tokenizer, max_queue=4, stop_token_ids=stop_token_ids(tokenizer))
    engine.start()
    prompt = "def add(a, b):"

    async def answer() -> tuple[str, str | None]:
        params = engine.check(Params(tuple(tokenizer.encode(prompt, add_special_tokens=False)), 24, temperature=0))
        text, finish = "", None
        async for event in engine.submit(params).events():
            text, finish = text + event.text, event.finish
        return text, finish

    try:
        text, finish = asyncio.run(answer())
    finally:
        engine.close()
    assert finish in ("length", "stop") and text == alone(prompt, 24)[0]
    assert next(rounds) > 4  # several rounds of each kind ran


def test_an_api_key_guards_every_route_but_health(pair, monkeypatch):
    """With a key, a request without it or with another gets 401 as an OpenAI error (the official client
    raises AuthenticationError); /health stays open for probes. The CLI takes the key from --api-key or
    DFLOW_RT_API_KEY."""
    from dflow_rt.commands.serve import api_key_of

    target, drafter, tokenizer = pair
    engine = Engine(Runtime(target, drafter, fixed(max_batch=2, max_len=MAX_LEN)), tokenizer, max_queue=2,
                    stop_token_ids=stop_token_ids(tokenizer))
    base, srv, thread = in_process(create_app(engine, MODEL, 1.0, api_key="s3cret"))
    try:
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert good.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, temperature=0).choices[0].text
        assert [m.id for m in good.models.list()] == [MODEL]
        for key in ("s3cre", "s3cret2", "S3CRET"):
            with pytest.raises(openai.AuthenticationError) as err:
                openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0).models.list()
            assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        for path in ("/v1/models", "/metrics", "/nowhere"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(base + path, timeout=10)
            assert err.value.code == 401 and json.loads(err.value.read())["error"]["code"] == "invalid_api_key"
        assert json.loads(urllib.request.urlopen(base + "/health", timeout=10).read())["status"] == "ok"
    finally:
        srv.should_exit = True
        thread.join(15)
    monkeypatch.setenv("DFLOW_RT_API_KEY", "from-env")
    assert api_key_of(argparse.Namespace(api_key=None)) == "from-env"
    assert api_key_of(argparse.Namespace(api_key="flag")) == "flag"
    monkeypatch.setenv("DFLOW_RT_API_KEY", "")
    assert api_key_of(argparse.Namespace(api_key=None)) is None
