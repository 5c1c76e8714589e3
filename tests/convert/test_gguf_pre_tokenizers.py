"""The pre-tokenizers of llama.cpp's `tokenizer.ggml.pre` values (strata/convert/gguf_checkpoint.py
PRE_TOKENIZERS): each splits text the way the family's own tokenizer does, on the cases that tell
them apart (digit runs, CJK after a space, case runs, contractions); an unknown value is refused in
one line naming the key."""

from __future__ import annotations

import pytest

from strata.convert.gguf_checkpoint import PRE_TOKENIZERS, pre_tokenizer

TEXT = "HelloWorld it's 1234567 日本語 x"
# the byte-level pieces (Ġ a space) each family's Hugging Face tokenizer makes of TEXT
EXPECTED = {
    "gpt2": ["HelloWorld", "Ġit", "'s", "Ġ1234567", "ĠæĹ¥æľ¬èªŀ", "Ġx"],
    "qwen2": ["HelloWorld", "Ġit", "'s", "Ġ", "1", "2", "3", "4", "5", "6", "7", "ĠæĹ¥æľ¬èªŀ", "Ġx"],
    "qwen35": ["HelloWorld", "Ġit", "'s", "Ġ", "1", "2", "3", "4", "5", "6", "7", "ĠæĹ¥æľ¬èªŀ", "Ġx"],
    "glm4": ["HelloWorld", "Ġit", "'s", "Ġ", "123", "456", "7", "ĠæĹ¥æľ¬èªŀ", "Ġx"],
    "deepseek-v3": ["HelloWorld", "Ġit", "'s", "Ġ", "123", "456", "7", "Ġ", "æĹ¥æľ¬èªŀ", "Ġx"],
    "gpt-4o": ["Hello", "World", "Ġit's", "Ġ", "123", "456", "7", "ĠæĹ¥æľ¬èªŀ", "Ġx"],
}
SAME = {"gpt-2": "gpt2", "default": "gpt2", "olmo": "gpt2", "deepseek-r1-qwen": "qwen2", "chatglm-bpe": "glm4", "minimax-m2": "gpt-4o"}


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_pre_tokenizer_splits_as_the_family_does(pre):
    pieces = [p for p, _ in pre_tokenizer(pre).pre_tokenize_str(TEXT)]
    assert pieces == EXPECTED[SAME.get(pre, pre)]


def test_qwen35_keeps_combining_marks_on_the_word():
    """Qwen3.5's regex adds \\p{M} to letters: a decomposed 'é' (e + U+0301) is one piece, where
    qwen2's splits the mark off."""
    text = "cafe\u0301s"
    qwen35 = [p for p, _ in pre_tokenizer("qwen35").pre_tokenize_str(text)]
    qwen2 = [p for p, _ in pre_tokenizer("qwen2").pre_tokenize_str(text)]
    assert len(qwen35) == 1 and len(qwen2) > 1


def test_an_unknown_pre_tokenizer_is_refused_naming_the_key(tmp_path, tmp_path_factory):
    import gguf

    from strata.convert import convert
    from strata.errors import ConfigError
    from tests import gguf_models, hf_models

    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    path = gguf_models.write_gguf(hf_dir, tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.pre"
    at = data.index(key) + len(key) + 4 + 8  # the value: u32 type, u64 length, then "gpt2"
    assert bytes(data[at:at + 4]) == b"gpt2"
    data[at:at + 4] = b"kimi"  # a pre-tokenizer strata does not know
    path.write_bytes(bytes(data))
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "kimi"
    with pytest.raises(ConfigError, match=r"tokenizer\.ggml\.pre = 'kimi'; supported: gpt2"):
        convert(path, tmp_path / "out")
