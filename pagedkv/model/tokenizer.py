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
        self.eos_id = int(eos_id)
        self.vocab_size = len(tokens)

    @classmethod
    def from_checkpoint(cls, ckpt) -> "Tokenizer":
        return cls(ckpt.tokens, ckpt.merges, ckpt.token_types, ckpt.eos_id)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token(self, i: int) -> str:
        """One token as text (special tokens kept)."""
        return self.decode([i], skip_special=False)

    def chat(self, user: str, system: str | None = DEFAULT_SYSTEM) -> list[int]:
        """The token ids of :func:`chat_prompt`."""
        return self.encode(chat_prompt(user, system))
