"""Text <-> token ids for SmolLM2, built from the GGUF file's own vocabulary and merges.

SmolLM2 uses byte-level BPE (GPT-2's scheme): text is first cut into pieces (every digit alone,
then GPT-2's pattern of words, numbers, punctuation and spaces), each piece's UTF-8 bytes are
spelled with a 256-character alphabet, and merges join adjacent symbols in priority order. The
control tokens (``<|im_start|>``, ``<|im_end|>``, ...) are special: matched whole, never split.
"""
from __future__ import annotations

__all__ = ["Tokenizer", "chat_prompt", "DEFAULT_SYSTEM"]

#: The system prompt SmolLM2's chat template inserts when a conversation has none.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CONTROL = 3  # GGUF token type of control tokens


def chat_prompt(user: str, system: str | None = DEFAULT_SYSTEM) -> str:
    """SmolLM2's chat template for one user message, ending where the assistant's answer
    starts. ``system=None`` leaves the system turn out altogether."""
    turns = [] if system is None else [("system", system)]
    turns.append(("user", user))
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + "<|im_start|>assistant\n"


class Tokenizer:
    """A ``tokenizers.Tokenizer`` built from a :class:`~pagedkv.model.gguf.Checkpoint`."""

    def __init__(self, tokens, merges, token_types, eos_id: int):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models
        from tokenizers import pre_tokenizers as pre

        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
        tok = HFTokenizer(bpe)
        tok.pre_tokenizer = pre.Sequence([
            pre.Digits(individual_digits=True),
            pre.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types) if kind == CONTROL])
        self._tok = tok
        # the same tokenizer with the control tokens read as plain text: for what a user
        # writes inside a chat turn, which must not be able to start a turn of its own
        self._text = HFTokenizer.from_str(tok.to_str())
        self._text.encode_special_tokens = True
        self.eos_id = int(eos_id)
        self.vocab_size = len(tokens)
        self.controls = {t: i for i, (t, kind) in enumerate(zip(tokens, token_types))
                         if kind == CONTROL}

    @classmethod
    def from_checkpoint(cls, ckpt) -> "Tokenizer":
        return cls(ckpt.tokens, ckpt.merges, ckpt.token_types, ckpt.eos_id)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """``text`` as ids with every character read as text: ``"<|im_start|>"`` in it
        becomes the ids of those characters, not the control token."""
        return self._text.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def decoder(self) -> "StreamDecoder":
        """An incremental decoder: the text of one more token at a time."""
        return StreamDecoder(self._tok)

    def token(self, i: int) -> str:
        """One token as text (special tokens kept)."""
        return self.decode([i], skip_special=False)

    def chat(self, user: str, system: str | None = DEFAULT_SYSTEM) -> list[int]:
        """The token ids of :func:`chat_prompt`."""
        return self.encode(chat_prompt(user, system))


class StreamDecoder:
    """Text one token at a time, for a stream (``tokenizers``' ``DecodeStream``): a token
    that ends in the middle of a UTF-8 character gives no text until the character is
    whole, and control tokens give none. The text of every ``step`` so far is the
    decoding of all the tokens so far, at O(1) work a token rather than O(length)."""

    def __init__(self, tok):
        from tokenizers.decoders import DecodeStream
        self._tok, self._stream = tok, DecodeStream(skip_special_tokens=True)

    def step(self, token: int) -> str:
        return self._stream.step(self._tok, int(token)) or ""
