"""Chapter 15 (serving it): how much of a streamed answer is safe to send while stop
strings may still appear, reading a server-sent event stream back, the text of one
more token with nothing but the tokenizer's ``decode``, and answers that keep the stop
string that ended them (the server's text half changed, checked on its engine client)."""
from __future__ import annotations

import itertools
import json
import random
import threading
import time

from pagedkv.serve.texts import Texts

from ._seeds import names_its_seed

__all__ = ["safe_length", "read_sse", "OffsetDecoder", "StopIncluded"]


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


@names_its_seed
def check_safe_length(impl=safe_length, seed=13, trials=400):
    """Against the brute force on random texts and stop strings over three letters, and
    a few cases worked by hand."""
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
    return {"random cases": trials}


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


@names_its_seed
def check_read_sse(impl=read_sse, seed=131, trials=200):
    """Streams written by the server's own encoder, cut at random byte positions, read
    back to the objects written; and a multi-line event by hand."""
    rng = random.Random(seed)
    for _ in range(trials):
        objs = [{"choices": [{"index": 0, "text": rng.choice(["a", "é", "\u2603", "\n"])
                              * rng.randrange(4)}], "n": k} for k in range(rng.randrange(6))]
        assert impl(_stream_of(objs, rng)) == objs
    assert impl([b'data: {"a":\r\ndata: 1}\r\n\r\ndata: [DONE]\n\n']) == [{"a": 1}]
    return {"streams": trials}


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


# ------------------------------------------------------------------ one token's text
class OffsetDecoder:
    """The text each new token adds, from ``tokenizer.decode`` of a few recent ids.
    ``prefix`` marks the ids whose text was sent in full, ``read`` the end of those
    sent: the text of ``ids[prefix:]`` beyond that of ``ids[prefix:read]`` is new,
    unless it ends in an unfinished character (U+FFFD), which waits for more. The
    window starts again after every piece sent, so each step decodes a handful of
    ids, however long the answer."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def step(self, token: int) -> str:
        self.ids.append(int(token))
        sent = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) > len(sent) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(sent):]
        return ""


CORPUS = ["Héllo wörld, ça va? ", "你好，世界！", "naïve café 🙂 ", "Ünïcödé ½ ",
          "The cat sat on the mat. ", "😀🚀 ok", "Ωmega ∑ ∞ → ∂ "]


def _byte_level_tokenizer():
    """A small byte-level BPE trained here: with every byte its own token and merges on
    top, a character of two or more bytes is often split between tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


class _Counting:
    """A tokenizer whose ``decode`` remembers the longest list of ids it was given."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, ids):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(list(ids))


@names_its_seed
def check_OffsetDecoder(impl=OffsetDecoder, seed=1313, trials=200):
    """The oracle is decoding the whole answer: on answers made of random pieces of
    text, the pieces joined are the whole text, every prefix of them is a prefix of it
    without an unfinished character, and no call decodes more than 16 ids. Characters
    of two to four bytes are split between tokens in these answers (counted)."""
    rng = random.Random(seed)
    tok = _byte_level_tokenizer()
    split = 0                    # tokens inside a character (alone: U+FFFD)
    for _ in range(trials):
        text = "".join(rng.choice(CORPUS)[rng.randrange(3):] for _ in range(rng.randrange(
            1, 6)))
        ids = tok.encode(text).ids
        whole = tok.decode(ids)
        split += sum("\ufffd" in tok.decode([t]) for t in ids)
        counting = _Counting(tok)
        decoder, out = impl(counting), ""
        for t in ids:
            out += decoder.step(t)
            assert whole.startswith(out) and "\ufffd" not in out, (text, out)
        assert out == whole, (text, out, whole)
        assert counting.longest <= 16, f"decoded {counting.longest} ids at once"
    assert split > 0, "no character was split between tokens: the case is not tested"
    return {"answers": trials, "tokens inside a character": split}


class _DecodeEachToken(OffsetDecoder):
    """Each token decoded alone: a character split between two tokens comes out as two
    replacement characters."""

    def step(self, token):
        return self.tokenizer.decode([int(token)])


class _WholeAnswer(OffsetDecoder):
    """Right text, but the whole answer decoded at every step: O(length) a token."""

    def step(self, token):
        before = self.tokenizer.decode(self.ids)
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        return text[len(before):] if not text.endswith("\ufffd") else ""


class _NoHolding(OffsetDecoder):
    """Sends text that ends in an unfinished character."""

    def step(self, token):
        self.ids.append(int(token))
        sent = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(sent):]



# --------------------------------------------------------------- keeping the stop string
class StopIncluded(Texts):
    """The engine loop's text half with answers that keep the stop string that ended
    them, as vLLM's ``include_stop_str_in_output`` does: the text is cut after the
    first stop string to appear, not before it."""

    @staticmethod
    def _extend(ch, tokens, stops) -> bool:
        before = len(ch.text)
        ch.text += "".join(ch.decoder.step(t) for t in tokens)
        ends = [i + len(s) for s in stops
                if (i := ch.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if ends:
            ch.text = ch.text[:min(ends)]      # the first to be complete ends the answer
        return bool(ends)


def _ask(client, prompt, params, stop=(), stream=True):
    """One job through a started engine client: (its text, the finish reasons, the
    events)."""
    from pagedkv.serve.texts import Delta, Done, Failed, Job, Rejected
    events, done = [], threading.Event()

    def emit(batch):
        events.extend(batch)
        if any(isinstance(e, (Done, Failed, Rejected)) for e in batch):
            done.set()

    assert client.submit(Job(prompt, params, emit, stop=tuple(stop), stream=stream)) is None
    assert done.wait(60), f"no answer within 60 s: {events}"
    assert isinstance(events[-1], Done), events[-1]
    deltas = [e for e in events if isinstance(e, Delta)]
    text = "".join(e.text for e in deltas)
    return text, [e.finish_reason for e in deltas], events


@names_its_seed
def check_StopIncluded(impl=StopIncluded, seed=15, trials=40):
    """On the server's engine client with the tiny random model on a thread of this
    process: a greedy answer with no stop string is the oracle; asked again with stop
    strings drawn from it, the answer must be its shortest prefix that holds one of
    them, streamed or not, ending with finish reason "stop", and every block back in the
    pool."""
    from pagedkv.model.requests import SamplingParams
    from pagedkv.serve.client import EngineClient
    from pagedkv.serve.models import load
    from pagedkv.serve.start import EngineSpec, make_engine
    from pagedkv.serve.transport import ThreadTransport
    rng = random.Random(seed)
    engine, info = make_engine(EngineSpec.of("tiny", num_blocks=64))
    tokenizer = load("tiny", model=False).tokenizer
    client = EngineClient(ThreadTransport(engine, info), tokenizer).start()
    client.texts = impl(tokenizer, engine.config.stop_ids)
    try:
        for _ in range(trials):
            prompt = tokenizer.encode_text("".join(
                rng.choice("abcdefgh ") for _ in range(rng.randrange(1, 12))))
            params = SamplingParams(max_new_tokens=24, ignore_eos=True)
            whole, _, _ = _ask(client, prompt, params)
            stops = []
            for _ in range(rng.randrange(1, 4)):
                i = rng.randrange(len(whole))
                stops.append(whole[i:i + rng.randrange(1, 4)])
            want = next(whole[:k] for k in range(len(whole) + 1)
                        if any(s in whole[:k] for s in stops))
            stream = rng.random() < 0.5
            text, reasons, _ = _ask(client, prompt, params, stops, stream)
            assert text == want, (whole, stops, text, want)
            assert reasons[-1] == "stop", (stops, reasons)
        pool = client.pool(audit=True).result(30)
        for _ in range(100):            # (the last cancel may still be on its way)
            if not pool["used"]:
                break
            time.sleep(0.05)
            pool = client.pool(audit=True).result(30)
        assert pool["used"] == 0 and pool["audit"] == "ok", pool
    finally:
        client.stop()
    return {"answers": trials}



class _StopAfterLatest(Texts):
    """Cut after the last stop string to complete, not the first."""

    @staticmethod
    def _extend(ch, tokens, stops) -> bool:
        before = len(ch.text)
        ch.text += "".join(ch.decoder.step(t) for t in tokens)
        ends = [i + len(s) for s in stops
                if (i := ch.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if ends:
            ch.text = ch.text[:max(ends)]
        return bool(ends)



WRONG = {
    "safe_length": [_safe_hold_longest_minus_one, _safe_whole_stops_only,
                    _safe_last_tail_only],
    "read_sse": [_sse_split_on_lines, _sse_past_done],
    "OffsetDecoder": [_DecodeEachToken, _WholeAnswer, _NoHolding],
    "StopIncluded": [Texts, _StopAfterLatest],
}
