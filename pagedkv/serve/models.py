"""What the server runs: SmolLM2-135M-Instruct from its GGUF file, or a tiny random Llama.

The tiny model (``--model tiny``) is for tests and for trying the server without the model
file: a two-layer Llama with random weights (:func:`pagedkv.model.random_weights`) and a
byte tokenizer (one id per UTF-8 byte, plus the chat template's control tokens), so any
text has ids. Its answers are noise; its code path is the real one.

Both come with the chat template :mod:`pagedkv.generate` uses: SmolLM2's, with its default
system prompt when the conversation has none.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..model.tokenizer import DEFAULT_SYSTEM
from .protocol import ROLES

__all__ = ["ROLES", "Served", "ByteTokenizer", "chat_text", "chat_ids", "load", "TINY_CONFIG",
           "TINY_SEED"]

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # ids 0, 1, 2
TINY_SEED = 2024


def chat_text(messages, default_system: str | None = DEFAULT_SYSTEM) -> str:
    """SmolLM2's chat template for a conversation (a list of ``(role, content)``), ending
    where the assistant's answer starts. With no system turn first, ``default_system`` is
    put there (``None``: none), as :func:`pagedkv.model.chat_prompt` does for one message.
    """
    turns = list(messages)
    if default_system is not None and (not turns or turns[0][0] != "system"):
        turns.insert(0, ("system", default_system))
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + "<|im_start|>assistant\n"


class ByteTokenizer:
    """Text <-> ids for the tiny model: the three control tokens are ids 0-2 (matched
    whole), every other byte ``b`` of the UTF-8 text is id ``b + 3``."""


    eos_id = 0
    vocab_size = 256 + len(SPECIALS)

    controls = {s: i for i, s in enumerate(SPECIALS)}

    def encode(self, text: str, controls: bool = True) -> list[int]:
        """``controls=False``: every character is text, the control tokens' too."""
        ids, i = [], 0
        while i < len(text):
            special = next((k for k, s in enumerate(SPECIALS) if text.startswith(s, i)),
                           None) if controls else None
            if special is not None:
                ids.append(special)
                i += len(SPECIALS[special])
            else:
                ids.extend(b + len(SPECIALS) for b in text[i].encode("utf-8"))
                i += 1
        return ids

    def encode_text(self, text: str) -> list[int]:
        return self.encode(text, controls=False)

    def decoder(self) -> "ByteDecoder":
        return ByteDecoder(self)

    def decode(self, ids, skip_special: bool = True) -> str:
        """One character a token: a byte is read as Latin-1, so that the text of a prefix
        is always a prefix of the text (a random model's bytes are rarely valid UTF-8)."""
        return "".join(chr(t - len(SPECIALS)) if t >= len(SPECIALS) else
                       "" if skip_special else SPECIALS[t] for t in map(int, ids))


class ByteDecoder:
    """The tiny tokenizer's text one token at a time (one character a token)."""

    def __init__(self, tokenizer: ByteTokenizer):
        self.tokenizer = tokenizer

    def step(self, token: int) -> str:
        return self.tokenizer.decode([token])


def chat_ids(tokenizer, messages, default_system: str | None = DEFAULT_SYSTEM) -> list:
    """The ids of :func:`chat_text` for ``messages``, each turn's role and content read
    as text (``tokenizer.encode_text``) between the control tokens' own ids: a message
    that contains ``"<|im_start|>"`` cannot start a turn of its own. Without control
    tokens in the messages the ids are those of ``tokenizer.encode(chat_text(...))``
    (a control token splits the text the same way)."""
    start, end = (tokenizer.controls[t] for t in ("<|im_start|>", "<|im_end|>"))
    turns = list(messages)
    if default_system is not None and (not turns or turns[0][0] != "system"):
        turns.insert(0, ("system", default_system))
    newline = tokenizer.encode_text("\n")
    ids = []
    for role, content in turns:
        ids += [start, *tokenizer.encode_text(f"{role}\n{content}"), end, *newline]
    return ids + [start, *tokenizer.encode_text("assistant\n")]


def _tiny_config():
    from ..model import LlamaConfig
    return LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden=64, layers=2, heads=4,
                       kv_heads=2, head_dim=64, ffn=128, rope_base=10000.0, context=2048)


TINY_CONFIG = None  # built on first use (importing the model package costs time)


@dataclass
class Served:
    """A model with its tokenizer, under the name clients ask for. ``max_token_chars``:
    the most characters one token stands for (its longest entry), so that a text of
    ``c`` characters has at least ``c / max_token_chars`` tokens."""
    name: str
    model: object          # a pagedkv.model.Llama (None: the tokenizer only)
    tokenizer: object      # encode(text), decode(ids), eos_id
    context: int
    vocab_size: int
    max_token_chars: int

    def chat_ids(self, turns) -> list:
        """The prompt's ids for a conversation (:func:`chat_ids`)."""
        return chat_ids(self.tokenizer, turns)


def load(which: str = "smollm2", gguf: str | None = None, *, model: bool = True) -> Served:
    """``"smollm2"``: the GGUF file (``gguf``, else ``$PAGEDKV_GGUF``, else the installed
    one); ``"tiny"``: the tiny random Llama. ``model=False`` reads the tokenizer and the
    sizes only (for a process that does not run the model). Raises :class:`ConfigError`
    for another name (and :class:`~pagedkv.model.ModelNotFound` when the file is
    missing)."""
    global TINY_CONFIG
    import numpy as np
    from ..model import Llama, Tokenizer, load_gguf, random_weights
    if which == "tiny":
        c = TINY_CONFIG = TINY_CONFIG or _tiny_config()
        llama = Llama(c, random_weights(c, TINY_SEED), xp=np) if model else None
        return Served("tiny-random-llama", llama, ByteTokenizer(), c.context, c.vocab_size,
                      max(map(len, SPECIALS)))
    if which != "smollm2":
        raise ConfigError(f"--model must be 'smollm2' or 'tiny', got {which!r}")
    ckpt = load_gguf(gguf, weights=model)
    tok = Tokenizer.from_checkpoint(ckpt)
    llama = Llama(ckpt.config, ckpt.weights) if model else None
    # (a byte-level BPE entry spells one byte a character, and a character is a byte or
    # more: no token stands for more characters than its entry has)
    return Served("SmolLM2-135M-Instruct", llama, tok, ckpt.config.context,
                  ckpt.config.vocab_size, max(map(len, ckpt.tokens)))
