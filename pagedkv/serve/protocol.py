"""OpenAI's request bodies in, engine arguments out; engine events in, OpenAI chunks out.

Every check here raises :class:`ApiError` (HTTP 400 unless said otherwise) with an
OpenAI-style error object: ``{"error": {"message", "type", "param", "code"}}``, which quotes
at most a short prefix of a bad value. Nothing reaches the engine until the whole body has
passed, and the cheap checks come first: a string prompt longer than the model's context
could hold even at the tokenizer's most characters a token is refused before it is
tokenized.

The fields read are OpenAI's and vLLM's ``ignore_eos``, ``min_tokens`` and ``top_k``.
OpenAI's sampling fields this server does not implement (:data:`UNIMPLEMENTED`) are
checked as OpenAI checks them, refused when invalid, and refused as unsupported unless
they ask for the default; ``user``, ``store``, ``metadata``, ``service_tier`` and
``parallel_tool_calls``, and any field neither OpenAI nor vLLM defines, are ignored (as
vLLM ignores them). The module imports neither the model nor the kernels: the HTTP layer
needs only the tokenizer, which it is given.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..config import SamplingParams
from ..errors import ConfigError, PagedKVError

__all__ = ["ApiError", "Spec", "parse_completion", "parse_chat", "parse_body", "text",
           "quote", "MAX_N", "MAX_STOP", "ROLES", "UNIMPLEMENTED"]

MAX_N = 16          # choices a request may ask for
MAX_STOP = 4        # stop strings (OpenAI's limit)
CHAT_MAX_TOKENS = 256   # the default answer length of a chat request
COMPLETION_MAX_TOKENS = 16   # OpenAI's default for completions
ROLES = ("system", "user", "assistant")
QUOTED = 40         # characters of a bad value an error message quotes


def quote(x) -> str:
    """``repr(x)``, or its first :data:`QUOTED` characters and how long it was."""
    r = repr(x)
    return r if len(r) <= QUOTED else f"{r[:QUOTED]}... ({len(r)} characters)"


def _num(lo, hi):
    return lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and lo <= x <= hi


def _intin(lo, hi):
    return lambda x: _is_int(x) and lo <= x <= hi


def _bias(x) -> bool:
    return isinstance(x, dict) and all(
        isinstance(k, str) and k.isdigit() and _num(-100, 100)(v) for k, v in x.items())


#: OpenAI's fields this server does not implement: (a valid value, is it one, the
#: default, is it that). A valid value other than the default is refused as unsupported.
UNIMPLEMENTED = {
    "presence_penalty": ("a number in [-2, 2]", _num(-2, 2), "0", lambda x: x == 0),
    "frequency_penalty": ("a number in [-2, 2]", _num(-2, 2), "0", lambda x: x == 0),
    "repetition_penalty": ("a number in (0, 2]", lambda x: _num(0, 2)(x) and x > 0, "1",
                           lambda x: x == 1),
    "min_p": ("a number in [0, 1]", _num(0, 1), "0", lambda x: x == 0),
    # best_of: an integer in [n, 16], n the default (below); logprobs: by endpoint
    "top_logprobs": ("an integer in [0, 20]", _intin(0, 20), "0", lambda x: x == 0),
    "echo": ("true or false", lambda x: isinstance(x, bool), "false", lambda x: not x),
    "suffix": ("a string", lambda x: isinstance(x, str), '""', lambda x: not x),
    "logit_bias": ("an object of token ids and numbers in [-100, 100]", _bias, "{}",
                   lambda x: not x),
    "tools": ("a list", lambda x: isinstance(x, list), "[]", lambda x: not x),
    "functions": ("a list", lambda x: isinstance(x, list), "[]", lambda x: not x),
    "tool_choice": ('"none", "auto", "required" or an object', lambda x: isinstance(x, dict)
                    or x in ("none", "auto", "required"), '"none"',
                    lambda x: x in ("none", "auto")),
    "response_format": ('an object with a "type"', lambda x: isinstance(x, dict) and
                        isinstance(x.get("type"), str), '{"type": "text"}',
                        lambda x: x.get("type") == "text"),
}
LOGPROBS = {"text_completion": ("an integer in [0, 5]", _intin(0, 5)),
            "chat.completion": ("true or false", lambda x: isinstance(x, bool))}


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
        raise ApiError(f"{name} must be a number in {left}{lo}, {hi}], got {quote(x)}",
                       name)
    return float(x)


def _int(body, name, default, lo, hi):
    x = body.get(name)
    if x is None:
        return default
    if not _is_int(x) or not lo <= x <= hi:
        raise ApiError(f"{name} must be an integer in [{lo}, {hi}], got {quote(x)}", name)
    return x


def _bool(body, name) -> bool:
    x = body.get(name)
    if x is None:
        return False
    if not isinstance(x, bool):
        raise ApiError(f"{name} must be true or false, got {quote(x)}", name)
    return x


def _fields(body, served, kind) -> None:
    """The cheap checks, before any prompt is read: the model's name, and OpenAI's
    fields this server does not implement (:data:`UNIMPLEMENTED`)."""
    if not isinstance(body.get("model"), str):
        raise ApiError("model is required: a string naming one of GET /v1/models", "model")
    if body["model"] != served.name:
        raise ApiError(f"the model {quote(body['model'])} does not exist; this server has "
                       f"{served.name!r}", "model", code="model_not_found")
    what, valid = LOGPROBS[kind]
    default = "0" if kind == "text_completion" else "false"
    n = body.get("n") if _is_int(body.get("n")) else 1
    table = dict(UNIMPLEMENTED, logprobs=(what, valid, default, lambda x: not x),
                 best_of=(f"an integer in [n = {n}, {MAX_N}]", _intin(n, MAX_N), "n",
                          lambda x: x == n))
    for name, (what, valid, default, is_default) in table.items():
        x = body.get(name)
        if x is None:
            continue
        if not valid(x):
            raise ApiError(f"{name} must be {what}, got {quote(x)}", name)
        if not is_default(x):
            raise ApiError(f"{name} = {quote(x)} is not supported by this server (leave it "
                           f"out, or give {default})", name)
    if "user" in body and not isinstance(body["user"], (str, type(None))):
        raise ApiError(f"user must be a string, got {quote(body['user'])}", "user")


def _fits(chars: int, served, param: str) -> None:
    """Refuse, before tokenizing it, a text of ``chars`` characters that has more tokens
    than the context holds even at the tokenizer's most characters a token."""
    least = -(-chars // served.max_token_chars)
    if least >= served.context:
        raise ApiError(f"the {param} has {chars} characters: at least {least} tokens (at "
                       f"most {served.max_token_chars} characters a token), and the "
                       f"model's context is {served.context}, which leaves no room for "
                       f"an answer", param, code="context_length_exceeded")


def _common(body, served, prompt, default_tokens, kind) -> Spec:
    """The parameters both endpoints share, checked against the model and its context."""
    param = "messages" if kind == "chat.completion" else "prompt"
    if not prompt:
        raise ApiError("the prompt is empty: give at least one token", param)
    room = served.context - len(prompt)
    if room < 1:
        raise ApiError(f"the prompt has {len(prompt)} tokens; the model's context is "
                       f"{served.context}, which leaves no room for an answer", param,
                       code="context_length_exceeded")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = min(default_tokens, room)
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise ApiError(f"max_tokens must be an integer >= 1, got {quote(max_tokens)}",
                       "max_tokens")
    elif max_tokens > room:
        raise ApiError(f"{len(prompt)} prompt tokens + max_tokens {max_tokens} exceed the "
                       f"model's context of {served.context} tokens", "max_tokens",
                       code="context_length_exceeded")
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0, 2),
            top_p=_number(body, "top_p", 1.0, 0, 1, lo_open=True),
            top_k=max(0, _int(body, "top_k", 0, -1, 2**31 - 1)),   # vLLM's; -1 or 0: off
            n=_int(body, "n", 1, 1, MAX_N), seed=_int(body, "seed", None, 0, 2**64 - 1),
            ignore_eos=_bool(body, "ignore_eos"),
            min_tokens=_int(body, "min_tokens", 0, 0, max_tokens))
    except ConfigError as exc:
        param = "n" if "samples" in str(exc) else None
        raise ApiError(str(exc).replace("max_new_tokens", "max_tokens"), param) from None
    stream, include_usage = _bool(body, "stream"), _stream_options(body)
    return Spec(list(prompt), params, _stop(body), stream, include_usage,
                body.get("pool", False) is True, kind)


def _stop(body) -> tuple:
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in stop):
        raise ApiError(f"stop must be a non-empty string or a list of at most {MAX_STOP} "
                       f"of them, got {quote(body.get('stop'))}", "stop")
    return tuple(text(s, "stop") for s in stop)


def _stream_options(body) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(f"stream_options must be an object, got {quote(options)}",
                       "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise ApiError("stream_options.include_usage must be true or false",
                       "stream_options")
    return bool(options.get("include_usage"))


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
    _fields(body, served, "text_completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _fits(len(prompt), served, "prompt")
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
        raise ApiError(f"messages[{i}].content must be a string, got {quote(content)}",
                       "messages")
    return text(content, "messages")


def parse_chat(body, served) -> Spec:
    """``POST /v1/chat/completions``: the messages in SmolLM2's chat template, its default
    system prompt first when there is no system message (as ``pagedkv.generate`` does).
    A message's text is read as text: the template's control tokens in it start no turn
    (``served.chat_ids``: :func:`~pagedkv.serve.models.chat_ids`)."""
    body = _object(body)
    _fields(body, served, "chat.completion")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects",
                       "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"messages[{i}] must be an object whose role is one of "
                           f"{', '.join(ROLES)}; got {quote(m)}", "messages")
        turns.append((m["role"], _content(m, i)))
    _fits(sum(len(c) for _, c in turns), served, "messages")
    return _common(body, served, served.chat_ids(turns), CHAT_MAX_TOKENS,
                   "chat.completion")


# ---------------------------------------------------------------------- responses
class Ids:
    """The id and creation time every chunk of one response repeats."""

    def __init__(self, kind: str, model: str):
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.kind, self.model = kind, model

    def chunk(self, choices, **extra) -> dict:
        """A stream's chunk; ``extra``: ``usage``, ``timings``, ``pool`` (None: left out)."""
        obj = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        out = dict(id=self.id, object=obj, created=self.created, model=self.model,
                   choices=choices)
        out.update((k, v) for k, v in extra.items() if v is not None)
        return out

    def delta_choice(self, index, text, finish_reason, first: bool) -> dict:
        if self.kind == "chat.completion":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return dict(index=index, delta=delta, logprobs=None, finish_reason=finish_reason)
        return dict(index=index, text=text, logprobs=None, finish_reason=finish_reason)

    def whole(self, texts, reasons, usage, timings=None) -> dict:
        if self.kind == "chat.completion":
            choices = [dict(index=i, message={"role": "assistant", "content": t},
                            logprobs=None, finish_reason=r)
                       for i, (t, r) in enumerate(zip(texts, reasons))]
        else:
            choices = [dict(index=i, text=t, logprobs=None, finish_reason=r)
                       for i, (t, r) in enumerate(zip(texts, reasons))]
        return dict(id=self.id, object=self.kind, created=self.created, model=self.model,
                    choices=choices, usage=usage, timings=timings)
