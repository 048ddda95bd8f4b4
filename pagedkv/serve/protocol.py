"""OpenAI's request bodies in, engine arguments out; engine events in, OpenAI chunks out.

Every check here raises :class:`ApiError` (HTTP 400 unless said otherwise) with an
OpenAI-style error object: ``{"error": {"message", "type", "param", "code"}}``. Nothing
reaches the engine until the whole body has passed.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..errors import ConfigError, PagedKVError
from ..model.requests import SamplingParams

__all__ = ["ApiError", "Spec", "parse_completion", "parse_chat", "parse_body", "text",
           "MAX_N", "MAX_STOP"]

MAX_N = 16          # choices a request may ask for
MAX_STOP = 4        # stop strings (OpenAI's limit)
CHAT_MAX_TOKENS = 256   # the default answer length of a chat request
COMPLETION_MAX_TOKENS = 16   # OpenAI's default for completions
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions",
               "logit_bias", "response_format")


class ApiError(PagedKVError):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = (
            message, param, status, code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class Spec:
    """A validated request: the prompt's ids and how to decode them."""
    prompt: list
    params: SamplingParams
    stop: tuple
    stream: bool
    include_usage: bool
    want_pool: bool
    kind: str              # "text_completion" or "chat.completion"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body, name, default, lo, hi, lo_open=False):
    x = body.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or \
            not (lo < x if lo_open else lo <= x) or not x <= hi:
        left = "(" if lo_open else "["
        raise ApiError(f"{name} must be a number in {left}{lo}, {hi}], got {x!r}", name)
    return float(x)


def _int(body, name, default, lo, hi):
    x = body.get(name)
    if x is None:
        return default
    if not _is_int(x) or not lo <= x <= hi:
        raise ApiError(f"{name} must be an integer in [{lo}, {hi}], got {x!r}", name)
    return x


def _common(body, served, prompt, default_tokens, kind) -> Spec:
    """The parameters both endpoints share, checked against the model and its context."""
    if not isinstance(body.get("model"), str):
        raise ApiError("model is required: a string naming one of GET /v1/models", "model")
    if body["model"] != served.name:
        raise ApiError(f"the model {body['model']!r} does not exist; this server has "
                       f"{served.name!r}", "model", code="model_not_found")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, [], {}):
            raise ApiError(f"{name} is not supported by this server", name)
    if not prompt:
        raise ApiError("the prompt is empty: give at least one token", "prompt"
                       if kind == "text_completion" else "messages")
    room = served.context - len(prompt)
    if room < 1:
        raise ApiError(f"the prompt has {len(prompt)} tokens; the model's context is "
                       f"{served.context}, which leaves no room for an answer",
                       "messages" if kind == "chat.completion" else "prompt",
                       code="context_length_exceeded")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = min(default_tokens, room)
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise ApiError(f"max_tokens must be an integer >= 1, got {max_tokens!r}",
                       "max_tokens")
    elif max_tokens > room:
        raise ApiError(f"{len(prompt)} prompt tokens + max_tokens {max_tokens} exceed the "
                       f"model's context of {served.context} tokens", "max_tokens",
                       code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, 0, 2)
    top_p = _number(body, "top_p", 1.0, 0, 1, lo_open=True)
    top_k = max(0, _int(body, "top_k", 0, -1, 2**31 - 1))   # vLLM's extension; -1 or 0: off
    n = _int(body, "n", 1, 1, MAX_N)
    seed = _int(body, "seed", None, 0, 2**64 - 1)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(f"ignore_eos must be true or false, got {ignore_eos!r}",
                       "ignore_eos")
    min_tokens = _int(body, "min_tokens", 0, 0, max_tokens)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in stop):
        raise ApiError(f"stop must be a non-empty string or a list of at most {MAX_STOP} "
                       f"of them, got {str(body.get('stop'))[:100]!r}", "stop")
    for s in stop:
        text(s, "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise ApiError("stream_options.include_usage must be true or false",
                       "stream_options")
    want_pool = body.get("pool", False) is True
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, n=n, seed=seed, ignore_eos=ignore_eos,
                                min_tokens=min_tokens)
    except ConfigError as exc:
        param = "n" if "samples" in str(exc) else None
        raise ApiError(str(exc).replace("max_new_tokens", "max_tokens"), param) from None
    return Spec(list(prompt), params, tuple(stop), stream,
                bool(options.get("include_usage")), want_pool, kind)


def parse_body(raw: bytes):
    """A request body as JSON, or a 400 that says what is wrong with it."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError("the request body is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ApiError(f"the request body is not UTF-8 (byte {exc.start})") from None
    except ValueError as exc:
        raise ApiError(f"the request body is not valid JSON ({len(raw)} bytes): "
                       f"{exc}"[:200]) from None


def text(s: str, param: str) -> str:
    """``s``, if it is text that UTF-8 can hold (JSON may carry a lone surrogate,
    ``"\\ud800"``, which no tokenizer can read)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"{param} is not valid Unicode: {exc.reason} at character "
                       f"{exc.start} (a lone surrogate?)", param) from None
    return s


def _object(body):
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got "
                       f"{type(body).__name__}")
    return body


def parse_completion(body, served) -> Spec:
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = served.tokenizer.encode(text(prompt, "prompt"))
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        vocab = served.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(f"prompt token ids must lie in [0, {vocab})", "prompt")
        ids = prompt
    else:
        raise ApiError("prompt must be a string or a list of token ids (one prompt a "
                       "request)", "prompt")
    return _common(body, served, ids, COMPLETION_MAX_TOKENS, "text_completion")


def _content(message, i):
    content = message.get("content")
    if isinstance(content, list):     # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and
                   isinstance(p.get("text"), str) for p in content):
            raise ApiError(f"messages[{i}].content: only text parts are supported",
                           "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(f"messages[{i}].content must be a string, got "
                       f"{str(content)[:100]!r}", "messages")
    return text(content, "messages")


def parse_chat(body, served) -> Spec:
    """``POST /v1/chat/completions``: the messages in SmolLM2's chat template, its default
    system prompt first when there is no system message (as ``pagedkv.generate`` does).
    A message's text is read as text: the template's control tokens in it start no turn
    (:func:`~pagedkv.serve.models.chat_ids`)."""
    from .models import ROLES, chat_ids
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects",
                       "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"messages[{i}] must be an object whose role is one of "
                           f"{', '.join(ROLES)}; got {m!r}"[:300], "messages")
        turns.append((m["role"], _content(m, i)))
    ids = chat_ids(served.tokenizer, turns)
    return _common(body, served, ids, CHAT_MAX_TOKENS, "chat.completion")


# ---------------------------------------------------------------------- responses
class Ids:
    """The id and creation time every chunk of one response repeats."""

    def __init__(self, kind: str, model: str):
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.kind, self.model = kind, model

    def chunk(self, choices, usage=None, pool=None) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        out = dict(id=self.id, object=obj, created=self.created, model=self.model,
                   choices=choices)
        if usage is not None:
            out["usage"] = usage
        if pool is not None:
            out["pool"] = pool
        return out

    def delta_choice(self, index, text, finish_reason, first: bool) -> dict:
        if self.kind == "chat.completion":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return dict(index=index, delta=delta, logprobs=None, finish_reason=finish_reason)
        return dict(index=index, text=text, logprobs=None, finish_reason=finish_reason)

    def whole(self, texts, reasons, usage) -> dict:
        if self.kind == "chat.completion":
            choices = [dict(index=i, message={"role": "assistant", "content": t},
                            logprobs=None, finish_reason=r)
                       for i, (t, r) in enumerate(zip(texts, reasons))]
        else:
            choices = [dict(index=i, text=t, logprobs=None, finish_reason=r)
                       for i, (t, r) in enumerate(zip(texts, reasons))]
        return dict(id=self.id, object=self.kind, created=self.created, model=self.model,
                    choices=choices, usage=usage)
