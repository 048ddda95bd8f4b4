"""The server as a client sees it: a real ``python -m pagedkv.serve`` process on 127.0.0.1
and a free port, started and stopped (by SIGINT, as Ctrl-C) by the tests, every wait
bounded. The tiny random Llama serves, except in the one test that compares with
``python -m pagedkv.generate`` on the real model.

After every test the pool is checked through ``GET /pool``: no block held, nothing
running or waiting, and the manager's audit passes (the server also audits after every
engine step: ``--audit``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams
from pagedkv.serve.models import ByteTokenizer, chat_text, load
from pagedkv.serve.process import ServerProcess, get_json

from _serving import idle, metric

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny-random-llama"
TIMEOUT = 30.0      # seconds any one call may take
LONG = 1500         # tokens: an answer that runs for a while on the tiny model
ENV = {**os.environ,   # this checkout first, and whatever the environment already adds
       "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}


_idle, _metric = idle, metric


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--model", "tiny", "--prefix-caching", "--audit", "--num-blocks", 256,
                       env=ENV, timeout=60) as s:
        yield s
        assert "Traceback" not in s.log(), s.log()
    assert s.proc.returncode == 0, s.log()


@pytest.fixture
def client(server):
    yield openai.OpenAI(base_url=server.base_url, api_key="none", timeout=TIMEOUT,
                        max_retries=0)
    pool = _idle(server)
    assert pool["audit"] == "ok", pool


@pytest.fixture(scope="module")
def oracle():
    """The tiny model in this process, on an engine of its own."""
    single_thread_blas()
    return load("tiny")


def _engine_greedy(served, prompt_ids, max_tokens):
    engine = Engine(served.model, num_blocks=256, stop_ids=[served.tokenizer.eos_id])
    (req,) = engine.generate([prompt_ids], SamplingParams(max_new_tokens=max_tokens))
    gen = req.outputs()[0].generated
    eos = bool(gen) and gen[-1] == served.tokenizer.eos_id
    return served.tokenizer.decode(gen[:-1] if eos else gen), len(gen), eos


def test_chat_template_is_generates():
    """One user message gets exactly the template `pagedkv.generate` applies."""
    from pagedkv.model.tokenizer import DEFAULT_SYSTEM, chat_prompt
    assert chat_text([("user", "Hi!")]) == chat_prompt("Hi!", DEFAULT_SYSTEM)
    assert chat_text([("system", "S"), ("user", "Hi!")]) == chat_prompt("Hi!", "S")
    tok = ByteTokenizer()
    ids = tok.encode("<|im_start|>a\u00e9")
    assert ids == [1, ord("a") + 3, 0xC3 + 3, 0xA9 + 3]
    assert tok.decode(ids, skip_special=False) == "<|im_start|>a\u00c3\u00a9"


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_greedy_equals_the_engine(client, oracle):
    """Non-streaming chat at temperature 0: the text and usage the engine gives directly
    for the same templated prompt."""
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                       temperature=0)
    ids = ByteTokenizer().encode(chat_text([("user", "Name a colour.")]))
    text, n, eos = _engine_greedy(oracle, ids, 40)
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if eos else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)
    assert r.usage.total_tokens == len(ids) + n


def test_fast_runner_serves_the_same_answer(oracle):
    """`--runner fast` (fused kernels; CUDA graphs on a GPU): greedy chat gives the plain
    engine's text."""
    with ServerProcess("--model", "tiny", "--runner", "fast", "--audit", env=ENV,
                       timeout=60) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="none", timeout=TIMEOUT,
                          max_retries=0)
        r = c.chat.completions.create(model=MODEL, max_tokens=40, temperature=0,
                                      messages=[{"role": "user", "content": "Name a colour."}])
        ids = ByteTokenizer().encode(chat_text([("user", "Name a colour.")]))
        assert r.choices[0].message.content == _engine_greedy(oracle, ids, 40)[0]
        assert _idle(s)["audit"] == "ok"
    assert s.proc.returncode == 0, s.log()


def test_streaming_equals_non_streaming(client):
    """The deltas of a stream add up to the non-streamed answer; the first chunk carries
    the role, the last choice chunk the finish reason, then one usage chunk."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count to ten."}],
              max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c for c in chunks if c.choices]
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == \
        whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert [c.choices[0].finish_reason for c in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert len(deltas) > 1                           # as it comes, not all at the end
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completions_and_token_prompts(client, oracle):
    """/v1/completions with a string and with the same prompt as token ids."""
    ids = ByteTokenizer().encode("Once upon a time")
    text, n, _ = _engine_greedy(oracle, ids, 20)
    a = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20,
                                  temperature=0)
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert a.choices[0].text == b.choices[0].text == text
    assert a.usage.prompt_tokens == len(ids) and a.usage.completion_tokens == n
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stream=True))
    assert streamed == text


def test_min_tokens_equal_to_max_tokens_and_a_full_context(client, server):
    """Over HTTP: ``min_tokens == max_tokens`` is answered with every token; a prompt and
    max_tokens that fill the context exactly are answered in full; one token more is
    refused (400, context_length_exceeded) and the engine is left unchanged."""
    r = client.completions.create(model=MODEL, prompt="a", max_tokens=8, temperature=0,
                                  extra_body={"min_tokens": 8})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    ids = [5] * 2040
    r = httpx.post(server.base_url + "/completions", timeout=TIMEOUT, json=dict(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == dict(prompt_tokens=2040, completion_tokens=8,
                                     total_tokens=2048)
    r = httpx.post(server.base_url + "/completions", timeout=TIMEOUT, json=dict(
        model=MODEL, prompt=ids, max_tokens=9, temperature=0, ignore_eos=True))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_n_seed_top_p(client):
    """n samples, reproducible with a seed; another seed gives other samples."""
    kw = dict(model=MODEL, prompt="abc", max_tokens=12, temperature=1.0, top_p=0.9, n=3)
    a = client.completions.create(**kw, seed=5)
    b = client.completions.create(**kw, seed=5)
    c = client.completions.create(**kw, seed=6)
    texts = lambda r: [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]  # noqa
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts(a) == texts(b) != texts(c)
    assert len(set(texts(a))) > 1
    # the tiny tokenizer writes one character a token; an end token writes none
    assert a.usage.completion_tokens == sum(len(ch.text) + (ch.finish_reason == "stop")
                                            for ch in a.choices)


def test_stop_strings(client):
    """A stop string cuts the answer before it (in a stream too) and ends it early; the
    request leaves the engine (the fixture checks the pool)."""
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=0)
    full = client.completions.create(**kw, max_tokens=80).choices[0].text
    stop = full[30:33]
    cut = full.index(stop)
    r = client.completions.create(**kw, max_tokens=80, stop=[stop, "\u2603never"])
    assert r.choices[0].text == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**kw, max_tokens=80, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]


def test_eight_concurrent_streams(client, server):
    """Eight streams at once, of different lengths and settings: all complete, each as
    it would alone, and their blocks come back."""
    results, errors = {}, []

    def run(i):
        try:
            stream = client.chat.completions.create(
                model=MODEL, max_tokens=20 + 10 * i, temperature=0,
                messages=[{"role": "user", "content": f"Question {i}?"}], stream=True)
            results[i] = "".join(c.choices[0].delta.content or "" for c in stream
                                 if c.choices)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    assert not errors and sorted(results) == list(range(8)), errors
    for i in (0, 7):
        alone = client.chat.completions.create(
            model=MODEL, max_tokens=20 + 10 * i, temperature=0,
            messages=[{"role": "user", "content": f"Question {i}?"}])
        assert alone.choices[0].message.content == results[i]
    pool = _idle(server)
    assert pool["cached"] > 0                # the shared system prompt stays cached
    assert _metric(server, "pagedkv_prefix_cache_hit_rate") > 0


def test_disconnect_frees_blocks(client, server):
    """A client that goes away mid-stream: its request is cancelled, its blocks freed,
    the audit passes."""
    before = _metric(server, "pagedkv_requests_cancelled_total")
    body = dict(model=MODEL, prompt="A long story:", max_tokens=LONG, temperature=0,
                stream=True, pool=True)
    with httpx.stream("POST", server.base_url + "/completions", json=body,
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [json.loads(line[6:]) for line, _ in zip(
            (x for x in lines if x.startswith("data: ")), range(20))]
    pools = [c["pool"] for c in got if "pool" in c]
    assert pools and any("m" in p for p in pools)       # it held blocks while it ran
    assert get_json(server.url + "/pool")  # (the server still answers)
    pool = _idle(server)
    assert pool["audit"] == "ok"
    assert _metric(server, "pagedkv_requests_cancelled_total") == before + 1


def test_disconnect_without_streaming(client, server):
    """A client that gives up waiting for a whole (non-streamed) answer: the server sees
    the connection close, cancels the request and frees its blocks."""
    before = _metric(server, "pagedkv_requests_cancelled_total")
    body = dict(model=MODEL, prompt="A long story:", max_tokens=LONG, temperature=0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=1.0)
    assert _idle(server)["audit"] == "ok"
    assert _metric(server, "pagedkv_requests_cancelled_total") == before + 1


def test_command_line_errors():
    """Bad flags: one line on stderr, status 2, nothing started."""
    for flags, words in ((["--num-blocks", "-1"], "--num-blocks must be at least 1"),
                         (["--max-waiting", "0"], "--max-waiting must be at least 1"),
                         (["--max-body", "0"], "--max-body must be at least 1"),
                         (["--read-timeout", "0"], "--read-timeout must be a positive"),
                         (["--allow-origin", "evil.example"], "--allow-origin takes"),
                         (["--stream-interval", "0"], "--stream-interval must be at least 1"),
                         (["--stall-timeout", "0"], "--stall-timeout must be a positive"),
                         (["--allowed-host", "a*.b"], "--allowed-host takes a name"),
                         (["--api-key", " "], "--api-key is empty"),
                         (["--speculate", "-1"], "--speculate must be at least 1"),
                         (["--kv-dtype", "int4"], "invalid choice: 'int4'")):
        r = subprocess.run([sys.executable, "-m", "pagedkv.serve", "--model", "tiny",
                            *flags], capture_output=True, text=True, env=ENV, timeout=60)
        assert r.returncode == 2 and words in r.stderr, (r.returncode, r.stderr)


def test_metrics(client, server):
    """The Prometheus text: every family, and counters that move with a request."""
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for name in ("pagedkv_blocks{state=\"used\"}", "pagedkv_blocks{state=\"free\"}",
                 "pagedkv_blocks{state=\"cached\"}", "pagedkv_requests_running",
                 "pagedkv_requests_waiting", "pagedkv_generation_tokens_total",
                 "pagedkv_prefix_cache_hit_rate", "pagedkv_requests_finished_total",
                 "pagedkv_engine_stalled", "pagedkv_engine_step_age_seconds"):
        assert name in text, name
    tokens = _metric(server, "pagedkv_generation_tokens_total")
    finished = _metric(server, "pagedkv_requests_finished_total")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=7, temperature=0)
    assert _metric(server, "pagedkv_generation_tokens_total") == \
        tokens + r.usage.completion_tokens
    assert _metric(server, "pagedkv_requests_finished_total") == finished + 1
    assert _metric(server, "pagedkv_engine_stalled") == 0
    assert 0 <= _metric(server, "pagedkv_engine_heard_age_seconds") < 30
    assert _metric(server, "pagedkv_blocks_total") == 256
    assert _metric(server, "pagedkv_spec_drafted_tokens_total") == 0     # (no --speculate)


def test_speculate_and_int8_flags(oracle):
    """``--speculate 4 --kv-dtype int8``: the server guesses (its drafted and accepted
    tokens in /metrics) and answers greedy requests exactly as an engine of its own with
    the 8-bit cache and no guesses: speculation changes how fast, never what."""
    prompt = "abc abc abc abc abc abc abc abc abc"
    ids = oracle.tokenizer.encode(prompt)
    engine = Engine(oracle.model, num_blocks=256, stop_ids=[oracle.tokenizer.eos_id],
                    kv_dtype="int8")
    (req,) = engine.generate([ids], SamplingParams(max_new_tokens=24))
    gen = req.outputs()[0].generated
    want = oracle.tokenizer.decode(gen[:-1] if gen[-1] == oracle.tokenizer.eos_id else gen)
    with ServerProcess("--model", "tiny", "--audit", "--num-blocks", 256, "--speculate", 4,
                       "--kv-dtype", "int8", env=ENV, timeout=60) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="none", timeout=TIMEOUT,
                          max_retries=0)
        assert _metric(s, "pagedkv_spec_drafted_tokens_total") == 0
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == want
        drafted = _metric(s, "pagedkv_spec_drafted_tokens_total")
        accepted = _metric(s, "pagedkv_spec_accepted_tokens_total")
        assert drafted > 0 and 0 <= accepted <= drafted, (drafted, accepted)
        pool = _idle(s)
        assert pool["audit"] == "ok" and pool["kv_dtype"] == "int8", pool
        assert "Traceback" not in s.log(), s.log()
    assert s.proc.returncode == 0


LONG_PROMPT = "x" * 2100        # more bytes than the tiny model's 2048-token context
BAD = [
    # (endpoint, body, param, words of the message)
    ("completions", b"{not json", None, "not valid JSON"),
    ("completions", [1, 2], None, "must be a JSON object"),
    ("completions", {"prompt": "a"}, "model", "model is required"),
    ("completions", {"model": "gpt-4", "prompt": "a"}, "model", "does not exist"),
    ("completions", {"model": MODEL, "prompt": LONG_PROMPT}, "prompt", "leaves no room"),
    ("completions", {"model": MODEL, "prompt": "a" * 2000, "max_tokens": 100},
     "max_tokens", "exceed the model's context of 2048"),
    ("completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens",
     "max_tokens must be an integer >= 1, got 0"),
    ("completions", {"model": MODEL, "prompt": "a", "max_tokens": "9"}, "max_tokens",
     "max_tokens must be an integer"),
    ("completions", {"model": MODEL, "prompt": "a", "n": 0}, "n", "n must be an integer "
     "in [1, 16], got 0"),
    ("completions", {"model": MODEL, "prompt": "a", "n": 17}, "n", "[1, 16], got 17"),
    ("completions", {"model": MODEL, "prompt": "a", "n": 2, "temperature": 0}, "n",
     "need a temperature > 0"),
    ("completions", {"model": MODEL, "prompt": "a", "temperature": 3}, "temperature",
     "temperature must be a number in [0, 2]"),
    ("completions", {"model": MODEL, "prompt": "a", "top_p": 0}, "top_p", "(0, 1]"),
    ("completions", {"model": MODEL, "prompt": "a", "seed": "s"}, "seed", "integer"),
    ("completions", {"model": MODEL, "prompt": "a", "stop": ["a"] * 5}, "stop",
     "at most 4"),
    ("completions", {"model": MODEL, "prompt": "a", "stream": "yes"}, "stream",
     "true or false"),
    ("completions", {"model": MODEL, "prompt": ""}, "prompt", "prompt is empty"),
    ("completions", {"model": MODEL, "prompt": [5, 999]}, "prompt", "[0, 259)"),
    ("completions", {"model": MODEL, "prompt": {"a": 1}}, "prompt", "string or a list"),
    ("completions", {"model": MODEL, "prompt": "a", "logprobs": 2}, "logprobs",
     "not supported"),
    ("chat/completions", {"model": MODEL, "messages": []}, "messages", "non-empty list"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     "messages", "role is one of system, user, assistant"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
     "messages", "content must be a string"),
    # the engine's own refusal: 16 samples of 1,000 tokens could never fit 256 blocks
    ("completions", {"model": MODEL, "prompt": "a", "n": 16, "max_tokens": 1000,
                     "temperature": 1}, None, "refused: the request may need 1008 blocks"),
]


@pytest.mark.parametrize("endpoint, body, param, words", BAD,
                         ids=[f"{i}-{b[2] or 'body'}" for i, b in enumerate(BAD)])
def test_bad_input(client, server, endpoint, body, param, words):
    """400 with an OpenAI error object naming the parameter; the engine unchanged."""
    before = get_json(server.url + "/pool")
    requests = _metric(server, "pagedkv_requests_total")
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.base_url}/{endpoint}", timeout=TIMEOUT,
                   headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert get_json(server.url + "/pool") == before
    assert _metric(server, "pagedkv_requests_total") == requests


def test_unknown_paths_and_methods(client, server):
    """404 and 405 come as OpenAI error objects too."""
    r = httpx.get(server.base_url + "/embeddings", timeout=TIMEOUT)
    assert r.status_code == 404 and "Not Found" in r.json()["error"]["message"]
    r = httpx.get(server.base_url + "/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and "GET /v1/completions" in r.json()["error"]["message"]


def test_binds_to_this_machine_by_default():
    from pagedkv.serve.__main__ import parser
    args = parser().parse_args([])
    assert (args.host, args.port, args.prefix_caching) == ("127.0.0.1", 8000, False)


def test_bad_input_through_the_client(client):
    """The openai client raises its BadRequestError with the server's message."""
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer >= 1"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[
            {"role": "user", "content": "hi"}])


def test_too_many_waiting_and_ctrl_c():
    """One sequence runs at a time and one request may wait: a third gets 429 (the
    openai client's RateLimitError). Then SIGINT with two streams open: the server
    stops cleanly, status 0."""
    with ServerProcess("--model", "tiny", "--max-seqs", 1, "--max-waiting", 1, "--audit",
                       env=ENV, timeout=60) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="none", timeout=TIMEOUT,
                          max_retries=0)
        body = dict(model=MODEL, prompt="a", max_tokens=LONG, temperature=0, stream=True)
        with httpx.stream("POST", s.base_url + "/completions", json=body,
                          timeout=TIMEOUT) as running:
            lines = running.iter_lines()       # (kept: a dropped iterator closes it)
            next(x for x in lines if x.startswith("data: {"))   # admitted, decoding
            with httpx.stream("POST", s.base_url + "/completions", json=body,
                              timeout=TIMEOUT) as waiting:
                assert waiting.status_code == 200           # accepted: it waits
                pool = get_json(s.url + "/pool")
                assert (pool["running"], pool["waiting"]) == (1, 1), pool
                with pytest.raises(openai.RateLimitError, match="at most 1"):
                    c.completions.create(model=MODEL, prompt="b", max_tokens=5)
                r = httpx.post(s.base_url + "/completions", json=body, timeout=TIMEOUT)
                assert r.status_code == 429
                assert r.json()["error"]["type"] == "rate_limit_error"
                t0 = time.monotonic()
                assert s.stop() == 0, s.log()
        assert time.monotonic() - t0 < 20
        assert "Traceback" not in s.log(), s.log()


def _model_available() -> bool:
    from pagedkv.model import ModelNotFound, model_path
    try:
        model_path()
        return True
    except ModelNotFound:
        return False


@pytest.mark.skipif(not _model_available(), reason="the SmolLM2 model file is not installed")
def test_real_model_equals_generate_cli():
    """SmolLM2 through the server (openai client, greedy) prints what
    `python -m pagedkv.generate` prints for the same prompt."""
    prompt, n = "What is the capital of France?", 12
    cli = subprocess.run([sys.executable, "-m", "pagedkv.generate", prompt,
                          "--max-new-tokens", str(n)], capture_output=True, text=True,
                         env=ENV, timeout=120, check=True)
    expected = cli.stdout.splitlines()[0]
    with ServerProcess("--num-blocks", 32, env=ENV, timeout=120) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="none", timeout=60, max_retries=0)
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=n,
                                      temperature=0,
                                      messages=[{"role": "user", "content": prompt}])
        streamed = "".join(ch.choices[0].delta.content or "" for ch in
                           c.chat.completions.create(
                               model="SmolLM2-135M-Instruct", max_tokens=n, temperature=0,
                               messages=[{"role": "user", "content": prompt}], stream=True))
    assert r.choices[0].message.content.strip() == expected
    assert streamed == r.choices[0].message.content
    print(f"server and CLI: {expected!r}")

