from hypothesis import given
from hypothesis import strategies as st

from strata.tokenizer import StreamingDetokenizer, Tokenizer, byte_level_tokenizer_json

TOK = Tokenizer.from_json(byte_level_tokenizer_json())


@given(st.text())
def test_byte_level_round_trip(text):
    assert TOK.decode(TOK.encode(text)) == text


@given(st.text())
def test_streaming_detokenizer_never_splits_characters(text):
    d = StreamingDetokenizer(TOK)
    pieces = [d.add(t) for t in TOK.encode(text)]
    pieces.append(d.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_one_token_per_byte_and_end_of_text():
    assert TOK.encode("aé") == [97, 0xC3, 0xA9]
    assert TOK.vocab_size == 257 and TOK.eos_ids == {256}
