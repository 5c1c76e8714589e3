"""Text <-> token ids through the `tokenizers` library, from the tokenizer.json stored in the model.

`byte_level_tokenizer_json()` builds the tokenizer of the made test models: byte-level BPE with
no merges (one token per byte) plus an end-of-text token, so any text round-trips exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

from strata.errors import FormatError

END_OF_TEXT = "<|endoftext|>"


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_level_tokenizer_json() -> str:
    """A byte-level tokenizer: ids 0..255 are the bytes, 256 is <|endoftext|>."""
    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([END_OF_TEXT])
    return tok.to_str()


@dataclass
class Tokenizer:
    """A loaded tokenizer; `eos_ids` are the ids that end generation."""

    hf: _HFTokenizer
    eos_ids: frozenset[int]
    chat_template: str | None = None

    @classmethod
    def from_json(cls, text: str, *, chat_template: str | None = None, source: str = "model",
                  eos_tokens: tuple[str, ...] = ()) -> "Tokenizer":
        """`eos_tokens`: the model's own end-of-sequence strings (a converted checkpoint's
        eos_token), in addition to the common names below."""
        try:
            hf = _HFTokenizer.from_str(text)
        except Exception as e:  # the tokenizers library raises plain Exceptions with long texts
            raise FormatError(f"{source}: the stored tokenizer.json does not load ({str(e).splitlines()[0]})") from e
        eos = {hf.token_to_id(t) for t in (END_OF_TEXT, "<|im_end|>", "</s>", "<|end_of_text|>", "<eos>", *eos_tokens)}
        return cls(hf, frozenset(i for i in eos if i is not None), chat_template)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. With add_special_tokens, the tokenizer's own post-processor runs
        (a Llama/Mixtral tokenizer.json adds its BOS there; byte-level and Qwen ones add nothing),
        as transformers' `tokenizer(text)` does for a plain prompt."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


class StreamingDetokenizer:
    """Turns a growing token list into text pieces without splitting a UTF-8 character.

    Each step decodes only the new token (`tokenizers`' DecodeStream holds back an incomplete
    multi-byte sequence until a later token completes it), so a long generation costs O(1) per
    token, not a re-decode of everything so far. `flush` emits whatever is still held back.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._tokens: list[int] = []
        self._emitted = 0  # characters handed out so far

    def add(self, token: int) -> str:
        self._tokens.append(token)
        piece = self._stream.step(self._tok.hf, token) or ""
        self._emitted += len(piece)
        return piece

    def flush(self) -> str:
        piece = self._tok.decode(self._tokens)[self._emitted:]
        self._emitted += len(piece)
        return piece
