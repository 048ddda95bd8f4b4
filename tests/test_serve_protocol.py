"""The HTTP schema on its own (no server): what it imports, the fields it does not
implement, how much of a bad value a message quotes, and the refusals that come before any
tokenizing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedkv.serve.models import ByteTokenizer, Served
from pagedkv.serve.protocol import (QUOTED, UNIMPLEMENTED, ApiError, parse_chat,
                                    parse_completion, quote)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny-random-llama"


class NoTokenizer(ByteTokenizer):
    """The tiny tokenizer, which counts what it encodes."""
    encoded = 0

    def encode(self, text, controls=True):
        NoTokenizer.encoded += len(text)
        return super().encode(text, controls)

    def encode_text(self, text):
        NoTokenizer.encoded += len(text)
        return super().encode(text, controls=False)


SERVED = Served(MODEL, None, NoTokenizer(), 2048, ByteTokenizer.vocab_size, 13)


def _refused(parse, body, param, words):
    with pytest.raises(ApiError) as e:
        parse(dict(model=MODEL, **body), SERVED)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    assert words in e.value.message, e.value.message
    return e.value


@pytest.mark.parametrize("module", ["protocol", "app", "client", "transport", "core",
                                    "messages", "start", "texts", "limits"])
def test_the_http_side_imports_neither_the_model_nor_the_kernels(module):
    """In a fresh interpreter: the module loads no pagedkv.model or pagedkv.kernels module
    (the server's process reads requests without them; only the engine's loads them)."""
    code = (f"import sys, pagedkv.serve.{module}; print(sorted(m for m in sys.modules "
            f"if m.startswith(('pagedkv.model', 'pagedkv.kernels'))))")
    path = [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]   # where the wheels may be
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("name, bad, unsupported, default", [
    ("presence_penalty", 100, 1.5, 0), ("frequency_penalty", -3, 0.5, 0.0),
    ("repetition_penalty", 0, 1.2, 1), ("min_p", 7, 0.1, 0), ("best_of", 0, 3, 1),
    ("top_logprobs", 21, 2, 0), ("echo", "yes", True, False), ("suffix", 3, "x", ""),
    ("logit_bias", {"a": 1}, {"5": 1}, {}), ("tools", {}, [{"type": "function"}], []),
    ("tool_choice", 3, "required", "none"),
    ("response_format", "json", {"type": "json_object"}, {"type": "text"}),
    ("logprobs", 6, 2, 0)])
def test_unimplemented_fields(name, bad, unsupported, default):
    """Invalid: refused with the field as param; valid but not the default: refused as
    unsupported; the default: accepted (never a 200 for best_of 0)."""
    _refused(parse_completion, {"prompt": "a", name: bad}, name, f"{name} must be")
    _refused(parse_completion, {"prompt": "a", name: unsupported}, name, "not supported")
    parse_completion(dict(model=MODEL, prompt="a", **{name: default}), SERVED)


def test_logprobs_and_best_of_follow_the_endpoint_and_n():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    _refused(parse_chat, {**chat, "logprobs": 1}, "logprobs", "true or false")
    _refused(parse_chat, {**chat, "logprobs": True}, "logprobs", "not supported")
    parse_chat(dict(model=MODEL, logprobs=False, **chat), SERVED)
    _refused(parse_completion, {"prompt": "a", "n": 3, "temperature": 1, "best_of": 2},
             "best_of", "best_of must be an integer in [n = 3, 16]")
    spec = parse_completion(dict(model=MODEL, prompt="a", n=3, temperature=1, best_of=3),
                            SERVED)
    assert spec.params.n == 3
    assert set(UNIMPLEMENTED) >= {"presence_penalty", "min_p", "logit_bias"}


def test_ignored_fields_are_ignored_but_checked():
    spec = parse_completion(dict(model=MODEL, prompt="a", user="u1", store=False,
                                 metadata={"a": "b"}, some_vendor_field=[1]), SERVED)
    assert spec.prompt == ByteTokenizer().encode("a")
    _refused(parse_completion, {"prompt": "a", "user": 5}, "user", "user must be a string")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "temperature": "x" * 200_000}, "temperature"),
    ({"prompt": "a", "max_tokens": "9" * 200_000}, "max_tokens"),
    ({"prompt": "a", "stop": {"k": "v" * 200_000}}, "stop"),
    ({"prompt": "a", "seed": [1] * 50_000}, "seed"),
    ({"prompt": "a", "presence_penalty": "p" * 200_000}, "presence_penalty"),
    ({"model": "m" * 200_000, "prompt": "a"}, "model"),
    ({"messages": [{"role": "robot" * 40_000, "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": {"c" * 200_000: 1}}]}, "messages"),
])
def test_a_bad_value_is_quoted_short(body, param):
    """An error message quotes at most QUOTED characters of a bad value, and how long
    it was."""
    parse = parse_chat if "messages" in body else parse_completion
    with pytest.raises(ApiError) as e:
        parse({"model": MODEL, **body}, SERVED)
    assert e.value.param == param
    assert len(e.value.message) < 200 + QUOTED, e.value.message
    assert "characters)" in e.value.message, e.value.message


def test_quote():
    assert quote("ab") == "'ab'"
    long = quote("x" * 1000)
    assert long.startswith("'xxx") and long.endswith("... (1002 characters)")
    assert len(long) < QUOTED + 30


def test_a_prompt_too_long_for_any_tokenizing_is_refused_before_it():
    """A string prompt with more characters than the context holds tokens at 13
    characters a token (the tiny tokenizer's longest entry) is refused unread; one just
    under the bound is tokenized, and refused after."""
    NoTokenizer.encoded = 0
    e = _refused(parse_completion, {"prompt": "x" * (13 * 2048)}, "prompt",
                 "at least 2048 tokens")
    assert e.code == "context_length_exceeded" and NoTokenizer.encoded == 0
    chat = [{"role": "user", "content": "y" * 30_000}]
    _refused(parse_chat, {"messages": chat}, "messages", "at least 2308 tokens")
    assert NoTokenizer.encoded == 0
    _refused(parse_completion, {"prompt": "x" * (13 * 2047)}, "prompt", "leaves no room")
    assert NoTokenizer.encoded == 13 * 2047


def test_the_cheap_checks_come_first():
    """A wrong model name or an invalid field is refused before the prompt is read."""
    NoTokenizer.encoded = 0
    with pytest.raises(ApiError, match="does not exist"):
        parse_completion({"model": "gpt-4", "prompt": "x" * 20_000}, SERVED)
    _refused(parse_completion, {"prompt": "x" * 20_000, "min_p": 7}, "min_p", "must be")
    assert NoTokenizer.encoded == 0


def test_the_timings_are_in_the_json_answer():
    from pagedkv.serve.protocol import Ids
    whole = Ids("text_completion", MODEL).whole(["a"], ["stop"], {"total_tokens": 2},
                                                {"queued_ms": 1.0})
    assert json.loads(json.dumps(whole))["timings"] == {"queued_ms": 1.0}


@pytest.mark.parametrize("parse, field", [(parse_completion, "max_tokens"),
                                          (parse_chat, "max_completion_tokens")])
def test_min_tokens_may_equal_max_tokens(parse, field):
    """``min_tokens == max_tokens`` is accepted (every token drawn without the end
    token); one more is refused."""
    body = {"prompt": "a"} if parse is parse_completion else \
        {"messages": [{"role": "user", "content": "a"}]}
    spec = parse(dict(model=MODEL, **body, **{field: 5, "min_tokens": 5}), SERVED)
    assert spec.params.min_tokens == spec.params.max_new_tokens == 5
    _refused(parse, dict(body, **{field: 5, "min_tokens": 6}), "min_tokens",
             "min_tokens must be an integer in [0, 5], got 6")


def test_a_completion_that_fills_the_context_is_accepted():
    """A prompt and max_tokens that fill the 2,048-token context exactly are accepted;
    one token more, the answer's or the prompt's, is refused (context_length_exceeded);
    a prompt of 2,047 tokens gets the one token left by default."""
    ids = [5] * 2040
    spec = parse_completion(dict(model=MODEL, prompt=ids, max_tokens=8), SERVED)
    assert len(spec.prompt) + spec.params.max_new_tokens == 2048
    e = _refused(parse_completion, {"prompt": ids, "max_tokens": 9}, "max_tokens",
                 "2040 prompt tokens + max_tokens 9 exceed the model's context of 2048")
    assert e.code == "context_length_exceeded"
    spec = parse_completion(dict(model=MODEL, prompt=[5] * 2047), SERVED)
    assert spec.params.max_new_tokens == 1
    e = _refused(parse_completion, {"prompt": [5] * 2048}, "prompt", "leaves no room")
    assert e.code == "context_length_exceeded"
