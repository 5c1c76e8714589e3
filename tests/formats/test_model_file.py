"""The dense model GGUF: round trips for every dense type and config shape, and every way a file
can be wrong (each a one-line FormatError / MissingTensorError naming the file)."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest

import strata.formats.model_file as model_file
from strata.errors import ConfigError, FormatError, MissingTensorError
from strata.formats.model_file import (
    KEY_CHAT_TEMPLATE,
    KEY_TOKENIZER_JSON,
    ModelFile,
    read_model,
    read_model_config,
    write_model,
)
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig, QKNorm, RoutingOrder, TensorNames, dense_tensor_shapes
from strata.reference.quants import dequantize, quantize

TOKENIZER = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}})
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"

QWEN2_LIKE = ModelConfig(
    architecture="qwen2_moe", vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
    n_experts=4, n_experts_per_token=2, expert_ffn_size=32, shared_ffn_size=64, shared_expert_gated=True,
    attention_bias=True, norm_topk_prob=False, rope_theta=1e6, rms_norm_eps=1e-6, max_context=512,
)
CONFIGS = {
    "qwen2_like": QWEN2_LIKE,
    "qwen3_like": ModelConfig(architecture="qwen3_moe", vocab_size=64, hidden_size=32, n_layers=1, n_heads=2,
                              n_kv_heads=1, head_dim=16, n_experts=8, n_experts_per_token=2, expert_ffn_size=32,
                              qk_norm=QKNorm.PER_HEAD, tie_embeddings=True),
    "olmoe_like": ModelConfig(architecture="olmoe", vocab_size=48, hidden_size=64, n_layers=1, n_heads=2,
                              n_kv_heads=2, head_dim=32, n_experts=4, n_experts_per_token=1, expert_ffn_size=32,
                              qk_norm=QKNorm.FULL, routing_order=RoutingOrder.TOPK_SOFTMAX, rms_norm_eps=1e-5),
}


def random_dense(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in dense_tensor_shapes(cfg).items()}


def assert_one_line_error(err: pytest.ExceptionInfo, *fragments: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, msg


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "model.gguf"
    write_model(path, QWEN2_LIKE, random_dense(QWEN2_LIKE), tokenizer_json=TOKENIZER, chat_template=TEMPLATE)
    return path


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_and_text_round_trip_exactly(tmp_path, name):
    cfg = CONFIGS[name]
    path = tmp_path / "m.gguf"
    write_model(path, cfg, random_dense(cfg), tokenizer_json=TOKENIZER, chat_template=TEMPLATE,
                extra_metadata={"general.name": "tiny", "strata_test.seed": 7, "strata_test.flags": [1, 2]})
    m = read_model(path)
    assert isinstance(m, ModelFile)
    assert m.cfg == cfg and read_model_config(path) == cfg
    assert m.path == str(path)
    assert (m.tokenizer_json, m.chat_template) == (TOKENIZER, TEMPLATE)
    assert m.metadata == {"general.name": "tiny", "strata_test.seed": 7, "strata_test.flags": [1, 2]}
    assert set(m.dense) == set(dense_tensor_shapes(cfg))


def test_chat_template_is_optional(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, QWEN2_LIKE, random_dense(QWEN2_LIKE), tokenizer_json=TOKENIZER)
    assert read_model(path).chat_template is None


def _expected(x: np.ndarray, qtype: QuantType) -> np.ndarray:
    """What a tensor stored as `qtype` reads back as (Q8_0 through strata's reference quantizer,
    which is ggml's rule: the gguf package must agree with it bit for bit)."""
    if qtype is QuantType.F32:
        return x
    if qtype is QuantType.F16:
        return x.astype(np.float16).astype(np.float32)
    return dequantize(quantize(qtype, x))


@pytest.mark.parametrize("dense_type", [QuantType.F32, QuantType.F16, QuantType.Q8_0], ids=lambda q: q.name)
def test_dense_round_trip_every_dense_type(tmp_path, dense_type):
    cfg, dense = QWEN2_LIKE, random_dense(QWEN2_LIKE)
    path = tmp_path / "m.gguf"
    write_model(path, cfg, dense, tokenizer_json=TOKENIZER, dense_type=dense_type)
    m = read_model(path)
    for name, shape in dense_tensor_shapes(cfg).items():
        is_router = name.endswith(TensorNames.router)
        want_type = QuantType.F32 if len(shape) == 1 or is_router else dense_type
        assert m.dense_types[name] is want_type, name
        got = m.dense[name]
        assert got.dtype == np.float32 and got.shape == shape, name
        np.testing.assert_array_equal(got, _expected(dense[name], want_type), err_msg=name)


def test_q8_0_falls_back_to_f32_for_rows_of_partial_blocks(tmp_path):
    # q_dim = 2 * 6 = 12: attn_output [32, 12] cannot be Q8_0; attn_q [12, 32] can
    cfg = ModelConfig(architecture="odd", vocab_size=40, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=6, n_experts=2, n_experts_per_token=1, expert_ffn_size=32)
    dense = random_dense(cfg)
    path = tmp_path / "m.gguf"
    write_model(path, cfg, dense, tokenizer_json=TOKENIZER, dense_type=QuantType.Q8_0)
    m = read_model(path)
    assert m.dense_types[TensorNames.block(0, TensorNames.attn_output)] is QuantType.F32
    assert m.dense_types[TensorNames.block(0, TensorNames.attn_q)] is QuantType.Q8_0
    np.testing.assert_array_equal(m.dense[TensorNames.block(0, TensorNames.attn_output)],
                                  dense[TensorNames.block(0, TensorNames.attn_output)])


def test_gguf_dims_are_reversed_numpy_dims(model_path):
    reader = gguf.GGUFReader(model_path)
    t = next(t for t in reader.tensors if t.name == TensorNames.token_embd)
    assert list(t.shape) == [QWEN2_LIKE.hidden_size, QWEN2_LIKE.vocab_size]  # ne0 = the row length
    assert reader.get_field("general.architecture").contents() == "strata"
    assert reader.get_field(KEY_TOKENIZER_JSON).contents() == TOKENIZER
    assert reader.get_field(KEY_CHAT_TEMPLATE).contents() == TEMPLATE


# ---------------------------------------------------------------- the writer refuses bad input


def test_writer_checks_dense_against_the_config(tmp_path):
    path = tmp_path / "m.gguf"
    router = TensorNames.block(1, TensorNames.router)
    cases = {
        "missing": ({k: v for k, v in random_dense(QWEN2_LIKE).items() if k != router}, router),
        "extra": ({**random_dense(QWEN2_LIKE), "blk.9.bogus.weight": np.zeros(3)}, "blk.9.bogus.weight"),
        "shape": ({**random_dense(QWEN2_LIKE), router: np.zeros((5, 32))}, router),
    }
    for dense, name in cases.values():
        with pytest.raises(ConfigError) as err:
            write_model(path, QWEN2_LIKE, dense, tokenizer_json=TOKENIZER)
        assert_one_line_error(err, name)
    with pytest.raises(ConfigError, match="Q2_0"):
        write_model(path, QWEN2_LIKE, random_dense(QWEN2_LIKE), tokenizer_json=TOKENIZER, dense_type=QuantType.Q2_0)
    with pytest.raises(ConfigError, match="reserved"):
        write_model(path, QWEN2_LIKE, random_dense(QWEN2_LIKE), tokenizer_json=TOKENIZER,
                    extra_metadata={"strata.n_layers": 3})
    assert os.listdir(tmp_path) == []


def test_interrupted_write_leaves_nothing_at_the_final_path(tmp_path):
    class Exploding:
        shape = (QWEN2_LIKE.n_experts, QWEN2_LIKE.hidden_size)

        def __array__(self, *args, **kwargs):
            raise RuntimeError("disk on fire")

    dense = {**random_dense(QWEN2_LIKE), TensorNames.block(1, TensorNames.router): Exploding()}
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_model(tmp_path / "m.gguf", QWEN2_LIKE, dense, tokenizer_json=TOKENIZER)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- broken files


def _write_with_shapes(monkeypatch, path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A strata GGUF whose tensors are `shapes` instead of what the config implies."""
    monkeypatch.setattr(model_file, "dense_tensor_shapes", lambda cfg: shapes)
    rng = np.random.default_rng(0)
    dense = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    write_model(path, QWEN2_LIKE, dense, tokenizer_json=TOKENIZER)
    monkeypatch.undo()


def test_missing_tensor_names_file_and_tensor(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    router = TensorNames.block(1, TensorNames.router)
    _write_with_shapes(monkeypatch, path, {k: v for k, v in dense_tensor_shapes(QWEN2_LIKE).items() if k != router})
    with pytest.raises(MissingTensorError) as err:
        read_model(path)
    assert_one_line_error(err, str(path), router)
    assert read_model_config(path) == QWEN2_LIKE  # metadata alone is fine


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    router = TensorNames.block(0, TensorNames.router)
    _write_with_shapes(monkeypatch, path, {**dense_tensor_shapes(QWEN2_LIKE), router: (5, 32)})
    with pytest.raises(FormatError) as err:
        read_model(path)
    assert_one_line_error(err, str(path), router, "expected shape (4, 32)", "found (5, 32)")


@pytest.mark.parametrize("content", [b"", b"hello, world" * 20, b"STRXPRT1" + bytes(400)], ids=["empty", "text", "experts"])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    for fn in (read_model, read_model_config):
        with pytest.raises(FormatError) as err:
            fn(path)
        assert_one_line_error(err, str(path), "not a GGUF file")


def test_missing_file(tmp_path):
    with pytest.raises(FormatError) as err:
        read_model(tmp_path / "nope.gguf")
    assert_one_line_error(err, str(tmp_path / "nope.gguf"), "cannot open")


@pytest.mark.parametrize("keep", [0.5, 0.05, 0.99])
def test_truncated_gguf(model_path, keep):
    raw = model_path.read_bytes()
    model_path.write_bytes(raw[: int(len(raw) * keep)])
    with pytest.raises(FormatError) as err:
        read_model(model_path)
    assert_one_line_error(err, str(model_path), "truncated or corrupt GGUF")


def _write_metadata_only(path, arch: str, kv: dict) -> None:
    w = gguf.GGUFWriter(path, arch)
    for key, (value, vtype) in kv.items():
        w.add_key_value(key, value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _strata_kv(cfg: ModelConfig) -> dict:
    t = gguf.GGUFValueType
    kinds = {bool: t.BOOL, int: t.UINT32, float: t.FLOAT64, str: t.STRING}
    kv = {"strata.format_version": (1, t.UINT32), KEY_TOKENIZER_JSON: (TOKENIZER, t.STRING)}
    kv.update({f"strata.{k}": (v, kinds[type(v)]) for k, v in cfg.to_dict().items()})
    return kv


def test_bad_strata_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    t = gguf.GGUFValueType
    good = _strata_kv(QWEN2_LIKE)
    _write_metadata_only(path, "strata", good)  # metadata right, tensors absent
    assert read_model_config(path) == QWEN2_LIKE
    with pytest.raises(MissingTensorError):
        read_model(path)
    cases = {
        "not a strata model": ("llama", good),
        "missing metadata key strata.n_heads": ("strata", {k: v for k, v in good.items() if k != "strata.n_heads"}),
        "strata.n_layers has type STRING": ("strata", {**good, "strata.n_layers": ("2", t.STRING)}),
        "invalid strata metadata": ("strata", {**good, "strata.n_heads": (0, t.UINT32)}),
        "unsupported strata model format version 9": ("strata", {**good, "strata.format_version": (9, t.UINT32)}),
    }
    for fragment, (arch, kv) in cases.items():
        _write_metadata_only(path, arch, kv)
        for fn in (read_model, read_model_config):
            with pytest.raises(FormatError) as err:
                fn(path)
            assert_one_line_error(err, str(path), fragment)


def test_float16_tensors_are_written_as_given_the_same_file_as_their_float32(tmp_path):
    dense = {n: v.astype(np.float16) for n, v in random_dense(QWEN2_LIKE).items()}
    as_f32 = {n: v.astype(np.float32) for n, v in dense.items()}
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_model(a, QWEN2_LIKE, dense, tokenizer_json=TOKENIZER, dense_type=QuantType.F16)
    write_model(b, QWEN2_LIKE, as_f32, tokenizer_json=TOKENIZER, dense_type=QuantType.F16)
    assert a.read_bytes() == b.read_bytes()
    m = read_model(a)  # and an F32-stored tensor given float16 (1-D, routers) is widened, not stored F16
    assert all(m.dense_types[n] is QuantType.F32 for n, s in dense_tensor_shapes(QWEN2_LIKE).items() if len(s) == 1)
