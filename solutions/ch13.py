"""Chapter 13 (serving it): how much of a streamed answer is safe to send while stop
strings may still appear, and reading a server-sent event stream back."""
from __future__ import annotations

import itertools
import json
import random

__all__ = ["safe_length", "read_sse"]


# ------------------------------------------------------------------ stop strings
def safe_length(text: str, stops) -> int:
    """How many leading characters of a partial answer can be sent now: the answer
    ends just before the first stop string in it, and any tail of the text that a stop
    string starts with may turn out to be the beginning of one."""
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    if first is not None:
        return first
    for i in range(len(text)):                 # the earliest tail that could grow into one
        tail = text[i:]
        if any(s.startswith(tail) for s in stops):
            return i
    return len(text)


def _brute_safe_length(text: str, stops, alphabet) -> int:
    """The oracle: an answer with a stop string in it has ended there; otherwise try
    every continuation up to the longest stop's length: a character is safe when no
    continuation puts a stop string's start at or before it."""
    ended = [i for i in range(len(text)) if any(text.startswith(s, i) for s in stops)]
    if ended:
        return ended[0]
    longest = max(len(s) for s in stops)
    worst = len(text)
    for n in range(longest + 1):
        for more in itertools.product(alphabet, repeat=n):
            full = text + "".join(more)
            hits = [i for i in (full.find(s) for s in stops) if i >= 0]
            if hits:
                worst = min(worst, min(hits))
    return worst


def check_safe_length(impl=safe_length, seed=13, trials=400):
    """Against the brute force on random texts and stop strings over three letters, and
    a few cases worked by hand."""
    print(f"seed={seed}")
    assert impl("Hello wor", ["world"]) == 6
    assert impl("Hello world!", ["world"]) == 6
    assert impl("abc", ["x"]) == 3
    assert impl("a\n\nb", ["\n\n", "b"]) == 1
    rng = random.Random(seed)
    alphabet = "abc"
    for _ in range(trials):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 4))]
        want = _brute_safe_length(text, stops, alphabet)
        got = impl(text, stops)
        assert got == want, (text, stops, got, want)
    return {"seed": seed, "random cases": trials}


def _safe_hold_longest_minus_one(text, stops):
    """What the server does: hold back as many characters as the longest stop string
    has, less one. Safe, but it holds back more than it must."""
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    if first is not None:
        return first
    return max(0, len(text) - (max(len(s) for s in stops) - 1))


def _safe_whole_stops_only(text, stops):
    """Only a stop string already in the text is held back: half of one leaks out."""
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    return len(text) if first is None else first


def _safe_last_tail_only(text, stops):
    """Looks at the last character only, not the longer tails."""
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    if first is not None:
        return first
    if text and any(s.startswith(text[-1]) for s in stops):
        return len(text) - 1
    return len(text)


# ------------------------------------------------------------------ server-sent events
def read_sse(chunks) -> list:
    """The JSON objects of an OpenAI stream, from the bytes as they arrive (``chunks``,
    cut anywhere, even inside a character), up to ``data: [DONE]``. An event is its
    ``data:`` lines joined by newlines, ended by a blank line; other fields and comment
    lines (starting with ``:``) carry no data."""
    out, buffer, raw = [], "", b""
    for chunk in chunks:
        raw += chunk
        try:
            text, raw = raw.decode("utf-8"), b""
        except UnicodeDecodeError as exc:          # a character cut in two: wait for it
            text, raw = raw[:exc.start].decode("utf-8"), raw[exc.start:]
        buffer += text.replace("\r\n", "\n")
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            data = [line[5:].removeprefix(" ") for line in event.split("\n")
                    if line.startswith("data:")]
            if not data:
                continue
            if data == ["[DONE]"]:
                return out
            out.append(json.loads("\n".join(data)))
    return out


def _stream_of(objs, rng):
    """A stream as the server writes it (its own encoder), cut at random places."""
    from pagedkv.serve.app import _sse
    raw = b": a comment\n\n" + b"".join(_sse(o) for o in objs) + b"data: [DONE]\n\n"
    raw += _sse({"after": "done"})
    cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randrange(0, 12))))
    return [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]


def check_read_sse(impl=read_sse, seed=131, trials=200):
    """Streams written by the server's own encoder, cut at random byte positions, read
    back to the objects written; and a multi-line event by hand."""
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(trials):
        objs = [{"choices": [{"index": 0, "text": rng.choice(["a", "é", "\u2603", "\n"])
                              * rng.randrange(4)}], "n": k} for k in range(rng.randrange(6))]
        assert impl(_stream_of(objs, rng)) == objs
    assert impl([b'data: {"a":\r\ndata: 1}\r\n\r\ndata: [DONE]\n\n']) == [{"a": 1}]
    return {"seed": seed, "streams": trials}


def _sse_split_on_lines(chunks):
    """Takes every `data:` line as one event: a chunk cut mid-line breaks it."""
    out = []
    for chunk in chunks:
        for line in chunk.decode("utf-8", errors="replace").splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                try:
                    out.append(json.loads(line[6:]))
                except ValueError:
                    pass
    return out


def _sse_past_done(chunks):
    """Reads on past [DONE]."""
    raw = b"".join(chunks).decode()
    return [json.loads(e[6:]) for e in raw.split("\n\n")
            if e.startswith("data: ") and e != "data: [DONE]"]


WRONG = {
    "safe_length": [_safe_hold_longest_minus_one, _safe_whole_stops_only,
                    _safe_last_tail_only],
    "read_sse": [_sse_split_on_lines, _sse_past_done],
}
