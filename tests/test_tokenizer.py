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


def _with_bos_post_processor() -> str:
    from tokenizers import Tokenizer as HF
    from tokenizers import processors

    hf = HF.from_str(byte_level_tokenizer_json())
    hf.add_special_tokens(["<s>"])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", hf.token_to_id("<s>"))])
    return hf.to_str()


def test_plain_prompts_get_the_tokenizers_own_special_tokens():
    tok = Tokenizer.from_json(_with_bos_post_processor())
    bos = tok.hf.token_to_id("<s>")
    assert tok.encode("hi", add_special_tokens=True) == [bos, 104, 105]
    assert tok.encode("hi") == [104, 105]


def test_the_models_own_eos_token_ends_generation(tmp_path):
    from tokenizers import Tokenizer as HF

    import strata
    from strata.formats.model_file import write_model
    from strata.testing.models import make_model

    hf = HF.from_str(byte_level_tokenizer_json())
    hf.add_special_tokens(["<|stop|>"])
    made = make_model(tmp_path / "m", "tiny", vocab_size=258)
    from strata.formats.model_file import read_model

    mf = read_model(made.model_path)
    write_model(made.model_path, mf.cfg, mf.dense, tokenizer_json=hf.to_str(),
                extra_metadata={"tokenizer.huggingface.eos_token": "<|stop|>"})
    model = strata.load(made.model_path)
    assert hf.token_to_id("<|stop|>") in model.tokenizer.eos_ids
    assert strata.generate(model, "a", max_tokens=1).tokens  # the model still generates
