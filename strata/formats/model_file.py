"""The dense model file: a GGUF (via the `gguf` package) holding the ModelConfig, the tokenizer,
the chat template and every dense tensor (attention, norms, routers, shared expert, embeddings,
head). Routed experts live in the separate `.experts` file (strata.formats.experts_file).

Metadata keys (docs/formats.md): `general.architecture = "strata"`, `strata.format_version`,
one `strata.<field>` per ModelConfig field, `tokenizer.huggingface.json`,
`tokenizer.chat_template`. Tensor names and numpy shapes are `dense_tensor_shapes(cfg)`
(llama.cpp's spelling); GGUF lists dims innermost first, the reverse of numpy, and the
`gguf` package's writer reverses on the way out; the reader here reverses on the way in.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass
from typing import Any, Collection

import numpy as np

from strata.errors import ConfigError, FormatError, MissingTensorError
from strata.formats.atomic import atomic_output
from strata.formats.dense_weights import DenseWeights, StoredTensor, StoredType, non_finite_blocks
from strata.formats.gguf_file import GGUFFile, open_gguf
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig, TensorNames, dense_tensor_shapes, stored_enum

ARCHITECTURE = "strata"
FORMAT_VERSION = 1
KEY_ARCHITECTURE = "general.architecture"
KEY_FORMAT_VERSION = "strata.format_version"
KEY_TOKENIZER_JSON = "tokenizer.huggingface.json"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
KEY_EXPERTS_IDENTITY = "strata.experts_identity"  # ExpertsFile.identity of the expert set written with it
KEY_NGRAMS_IDENTITY = "strata.ngrams_identity"  # NgramRowsFile.identity of the PLE row store written with it
KEY_FILE_CHECKSUM = "strata.file_checksum"  # u32 CRC-32 of the whole file, these 4 value bytes read as 0
CONFIG_PREFIX = "strata."

# A bound on `strata.n_layers` checked before anything is built from it: the deepest MoE models
# have under a hundred layers; 2**32 - 1 would make ModelConfig spell out four billion layer kinds.
MAX_LAYERS = 1 << 14
DENSE_TYPES = (QuantType.F32, QuantType.F16, QuantType.Q8_0)  # what write_model can store 2-D matrices as


@dataclass(frozen=True, eq=False)
class StoredBlocks:
    """A dense matrix handed to `write_model` as a GGUF already stores it (a llama.cpp GGUF's own
    Q6_K / Q8_0 / BF16 ... tensor, kept as stored): written with its bytes unchanged, whatever the
    `dense_type`. `read` is called once, when the writer gets to it.

    Shapes: shape = the numpy shape of the matrix; read() -> uint8 [..., row_bytes] (the
    tensor's rows of ggml blocks, or of raw floats for F32 / F16 / BF16)
    """

    ggml_type: int
    shape: tuple[int, ...]
    read: Any  # () -> np.ndarray


def _gguf():
    import gguf  # imported late: `import strata` stays cheap for tools that never touch GGUF

    return gguf


# ModelConfig field type (its annotation string) -> GGUF value type name. A new field type must
# be added here; the assert below fails at import otherwise.
_FIELD_VALUE_TYPES = {"int": "UINT32", "bool": "BOOL", "float": "FLOAT64", "str": "STRING",
                      "tuple[LayerType, ...]": "STRING"}
# The fields format version 1 shipped with: every file has them. A field added since has a
# default, and a file without it gets that default (every layer attention + MoE, no dense FFN,
# no new family's feature), which is what such a file describes.
_V1_FIELDS = frozenset({
    "architecture", "vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts",
    "n_experts_per_token", "expert_ffn_size", "shared_ffn_size", "shared_expert_gated", "routing_order",
    "norm_topk_prob", "qk_norm", "attention_bias", "rope_theta", "rms_norm_eps", "max_context", "tie_embeddings",
})


def _value_type(field: dataclasses.Field) -> str:
    """A stored field's GGUF value type: an enum (strata/layer_kinds.py) is its string value."""
    return "STRING" if stored_enum(field) is not None else _FIELD_VALUE_TYPES[str(field.type)]


assert all(stored_enum(f) or str(f.type) in _FIELD_VALUE_TYPES for f in ModelConfig.stored_fields()), \
    "new ModelConfig field type"


def config_key(field_name: str) -> str:
    return CONFIG_PREFIX + field_name


_RESERVED_KEYS = frozenset(
    [KEY_ARCHITECTURE, KEY_FORMAT_VERSION, KEY_TOKENIZER_JSON, KEY_CHAT_TEMPLATE, KEY_EXPERTS_IDENTITY,
     KEY_FILE_CHECKSUM, KEY_NGRAMS_IDENTITY, "general.alignment"]
    + [config_key(f.name) for f in ModelConfig.stored_fields()]
)


@dataclass(frozen=True, eq=False)
class ModelFile:
    """A dense model read from GGUF.

    Shapes:
        dense[name]: float32, the shape dense_tensor_shapes(cfg)[name] ([out, in] for matrices),
            widened on access from what the file stores (dense.stored(name))
    """

    path: str
    cfg: ModelConfig
    dense: DenseWeights
    tokenizer_json: str
    chat_template: str | None
    dense_types: dict[str, Any]  # QuantType where one exists, else the gguf GGMLQuantizationType
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra_metadata given to write_model
    experts_identity: str | None = None  # the expert set it was written with; None in older files
    ngrams_identity: str | None = None  # the PLE row store it was written with (None: none recorded)


# ---------------------------------------------------------------- writer


def stored_type_of(name: str, shape: tuple[int, ...], dense_type: QuantType) -> QuantType:
    """Routers and 1-D tensors are always F32. Matrices take dense_type, except that a row
    length that is not a whole number of Q8_0 blocks stays F32 (documented in docs/formats.md)."""
    if len(shape) == 1 or name.endswith("." + TensorNames.router):
        return QuantType.F32
    if dense_type is QuantType.Q8_0 and shape[-1] % 32:
        return QuantType.F32
    return dense_type


def _check_dense(cfg: ModelConfig, dense: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    shapes = dense_tensor_shapes(cfg)
    missing = [n for n in shapes if n not in dense]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"write_model: missing dense tensor {missing[0]}{more}")
    extra = [n for n in dense if n not in shapes]
    if extra:
        raise ConfigError(f"write_model: unexpected tensor {extra[0]} (not a dense tensor of this config)")
    for name, want in shapes.items():
        got = tuple(np.shape(dense[name]))
        if got != want:
            raise ConfigError(f"write_model: tensor {name}: expected shape {want}, got {got}")
    return shapes


def _add_value(writer, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float64(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)) and value:
        writer.add_array(key, list(value))
    else:
        raise ConfigError(f"write_model: metadata {key!r}: unsupported value {value!r} (use str, int, float, bool or a list)")


def write_model(
    path: str | os.PathLike,
    cfg: ModelConfig,
    dense: dict[str, np.ndarray],
    *,
    tokenizer_json: str,
    chat_template: str | None = None,
    dense_type: QuantType = QuantType.F32,
    extra_metadata: dict[str, Any] | None = None,
    experts_identity: str | None = None,
    ngrams_identity: str | None = None,
) -> None:
    """Write the dense model as GGUF: to `path + ".tmp"`, renamed over `path` when complete.

    `experts_identity` (`ExpertsFile.identity` of the `.experts` written beside it) ties the pair:
    loading it with another expert set is then refused (docs/formats.md, "The pair").
    `ngrams_identity` (`NgramRowsFile.identity`) does the same for a PLE model's row store.

    Shapes:
        dense[name]: dense_tensor_shapes(cfg)[name], any float dtype (stored as described above),
            or a StoredBlocks (a matrix written as it is already stored)
    """
    gguf = _gguf()
    path = os.fspath(path)
    dense_type = QuantType(dense_type)
    if dense_type not in DENSE_TYPES:
        raise ConfigError(f"write_model: dense_type {dense_type.name} not supported; use one of "
                          f"{', '.join(q.name for q in DENSE_TYPES)}")
    shapes = _check_dense(cfg, dense)
    for key in extra_metadata or {}:
        if key in _RESERVED_KEYS or key.startswith(CONFIG_PREFIX) or key.startswith("GGUF."):
            raise ConfigError(f"write_model: extra metadata key {key!r} is reserved")
    with atomic_output(path) as tmp:
        w = gguf.GGUFWriter(tmp, ARCHITECTURE)
        w.add_uint32(KEY_FORMAT_VERSION, FORMAT_VERSION)
        types = {f.name: _value_type(f) for f in ModelConfig.stored_fields()}
        for name, value in cfg.to_dict().items():
            w.add_key_value(config_key(name), value, gguf.GGUFValueType[types[name]])
        w.add_string(KEY_TOKENIZER_JSON, tokenizer_json)
        if chat_template is not None:
            w.add_string(KEY_CHAT_TEMPLATE, chat_template)
        if experts_identity is not None:
            w.add_string(KEY_EXPERTS_IDENTITY, experts_identity)
        if ngrams_identity is not None:
            w.add_string(KEY_NGRAMS_IDENTITY, ngrams_identity)
        w.add_uint32(KEY_FILE_CHECKSUM, 0)  # patched below, once every byte it covers is written
        for key, value in (extra_metadata or {}).items():
            _add_value(w, key, value)
        for name, shape in shapes.items():
            qt = stored_type_of(name, shape, dense_type)
            if isinstance(dense[name], StoredBlocks):
                kept = dense[name]
                if stored_type_of(name, shape, QuantType.F16) is QuantType.F32 and kept.ggml_type != int(QuantType.F32):
                    raise ConfigError(f"write_model: tensor {name} must be F32 (a router or 1-D tensor), "
                                      f"got stored type {kept.ggml_type}")
                ggml_type = gguf.GGMLQuantizationType(kept.ggml_type)
                w.add_tensor(name, np.ascontiguousarray(kept.read(), np.uint8), raw_dtype=ggml_type)
                continue
            if qt is QuantType.F16 and np.asarray(dense[name]).dtype == np.float16:
                w.add_tensor(name, np.ascontiguousarray(dense[name]))  # as given: float32 and back is the identity
                continue
            x = np.ascontiguousarray(dense[name], dtype=np.float32)
            if qt is QuantType.F32:
                w.add_tensor(name, x)
            elif qt is QuantType.F16:
                w.add_tensor(name, x.astype(np.float16))
            else:
                ggml_type = gguf.GGMLQuantizationType(int(qt))
                w.add_tensor(name, gguf.quants.quantize(x, ggml_type), raw_dtype=ggml_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        _seal(tmp)


def _seal(path: str) -> None:
    """Write the file checksum into its placeholder and flush the file to disk."""
    gf = open_gguf(path)
    try:
        at = gf.fields[KEY_FILE_CHECKSUM].offset
        crc = gf.crc32_without(at, 4)
    finally:
        gf.close()
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, struct.pack("<I", crc), at)
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_sum(gf: GGUFFile) -> None:
    """The whole file against its checksum (files without one, older ones, skip this): a flipped
    bit anywhere (a weight, the tokenizer, a config value) is refused, never computed with."""
    f = gf.fields.get(KEY_FILE_CHECKSUM)
    if f is None:
        return
    if f.type_name != "UINT32":
        raise FormatError(f"{gf.path}: metadata key {KEY_FILE_CHECKSUM} has type {f.type_name}, expected UINT32")
    actual = gf.crc32_without(f.offset, 4)
    if actual != f.value:
        raise FormatError(f"{gf.path}: checksum mismatch (crc32 {actual:#010x}, the file says {f.value:#010x}): "
                          "the file is damaged")


# ---------------------------------------------------------------- reader


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _field(gf: GGUFFile, key: str, required: bool = True) -> Any:
    f = gf.fields.get(key)
    if f is None:
        if required:
            raise FormatError(f"{gf.path}: missing metadata key {key}")
        return None
    return f.value


def _string_field(gf: GGUFFile, key: str, required: bool = True) -> str | None:
    f = gf.fields.get(key)
    if f is not None and f.type_name != "STRING":
        raise FormatError(f"{gf.path}: metadata key {key} has type {f.type_name}, expected STRING")
    return _field(gf, key, required)


def _config(gf: GGUFFile) -> ModelConfig:
    path = gf.path
    arch = _field(gf, KEY_ARCHITECTURE)
    if arch != ARCHITECTURE:
        raise FormatError(f"{path}: not a strata model file ({KEY_ARCHITECTURE} is {arch!r}, expected {ARCHITECTURE!r})")
    version = _field(gf, KEY_FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise FormatError(f"{path}: unsupported strata model format version {version} (this reader knows {FORMAT_VERSION})")
    values = {}
    for f in ModelConfig.stored_fields():
        key = config_key(f.name)
        want = _value_type(f)
        field = gf.fields.get(key)
        if field is None and f.name not in _V1_FIELDS:
            continue
        if field is None:
            raise FormatError(f"{path}: missing metadata key {key}")
        if field.type_name != want:
            raise FormatError(f"{path}: metadata key {key} has type {field.type_name}, expected {want}")
        values[f.name] = field.value
    layers = values.get("n_layers")
    if isinstance(layers, int) and layers > MAX_LAYERS:  # before ModelConfig builds per-layer tuples
        raise FormatError(f"{path}: {config_key('n_layers')} = {layers}, more than any model has ({MAX_LAYERS})")
    try:
        cfg = ModelConfig.from_dict(values)
    except (ConfigError, ValueError) as e:
        raise FormatError(f"{path}: invalid strata metadata: {_one_line(e)}") from e
    return cfg


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a model file, from its metadata only (no tensor data is read)."""
    gf = open_gguf(path)
    try:
        return _config(gf)
    finally:
        gf.close()


def read_experts_identity(path: str | os.PathLike) -> str | None:
    """The identity of the expert set a model file was written with (None: an older file)."""
    gf = open_gguf(path)
    try:
        return _string_field(gf, KEY_EXPERTS_IDENTITY, required=False)
    finally:
        gf.close()


def read_file_checksum(path: str | os.PathLike) -> int | None:
    """The CRC-32 a model file records of itself (None: an older file without one); not verified
    here (read_model does), so it names the file's content cheaply."""
    gf = open_gguf(path)
    try:
        f = gf.fields.get(KEY_FILE_CHECKSUM)
        return int(f.value) if f is not None and f.type_name == "UINT32" else None
    finally:
        gf.close()


def _quant_type(ggml_type) -> Any:
    try:
        return QuantType(int(ggml_type))
    except ValueError:
        return ggml_type


INTEGER_TYPES = frozenset({"I8", "I16", "I32", "I64"})  # ggml's integer tensor types


def _check_type(path: str, name: str, shape: tuple[int, ...], ggml_type) -> None:
    """Routers and 1-D tensors are F32 (docs/formats.md); no tensor is an integer type. A type
    of the same byte size swapped in (F32 <-> I32) is what the offsets cannot catch."""
    if (len(shape) == 1 or name.endswith("." + TensorNames.router)) and int(ggml_type) != int(QuantType.F32):
        raise FormatError(f"{path}: tensor {name}: stored as {ggml_type.name}, but routers and 1-D tensors are F32")
    if ggml_type.name in INTEGER_TYPES:  # I8..I64; the IQ* names are weight types
        raise FormatError(f"{path}: tensor {name}: integer type {ggml_type.name} is not a weight type")


def _dequantize(gf: GGUFFile, name: str, info, want: tuple[int, ...]) -> np.ndarray | StoredTensor:
    return held_dense(gf.path, name, info.ggml_type, gf.raw(info), want)


def held_dense(path: str, name: str, ggml_type: int, raw: np.ndarray, want: tuple[int, ...]) -> np.ndarray | StoredTensor:
    """A tensor as it is kept in memory: F16, BF16, Q8_0 and the block types with a compiled CPU
    kernel as stored (a StoredTensor, widened per use: strata.formats.dense_weights), any other
    type widened to float32 now; checked finite.
    raw: its stored bytes (`GGUFFile.raw`'s view, or the uint8 rows of blocks: the same bytes),
    from a model file or from a llama.cpp GGUF read in place (strata/convert/gguf_in_place.py)."""
    gguf = _gguf()
    ggml_type = gguf.GGMLQuantizationType(ggml_type)
    _check_type(path, name, want, ggml_type)
    stored = StoredType.of(int(ggml_type))
    if stored is not None and len(want) >= 1:
        t = StoredTensor.from_gguf(stored, raw, want)
        if not _stored_finite(t):  # rare: the full check below names the count and the first place
            _check_finite(path, name, t.widen(), want)
        return t
    try:
        x = gguf.quants.dequantize(raw, ggml_type)
    except Exception as e:
        raise FormatError(f"{path}: tensor {name}: cannot dequantize {ggml_type.name}: {_one_line(e)}") from e
    x = np.array(x, dtype=np.float32).reshape(want)  # a copy: no view into the map
    _check_finite(path, name, x, want)
    return x


def _stored_finite(t: StoredTensor) -> bool:
    """Every value of a stored tensor finite, without widening it (a Q8_0 value is finite
    when its block's scale is: the codes are integers)."""
    if t.qtype is StoredType.F16:
        return bool(np.isfinite(t.codes).all())
    if t.qtype is StoredType.BF16:
        return not bool(((t.codes & 0x7F80) == 0x7F80).any())  # exponent all ones: inf or NaN
    if t.qtype.whole_blocks:
        return non_finite_blocks(t) == 0
    return bool(np.isfinite(t.scales).all())


def _check_finite(path: str, name: str, x: np.ndarray, want: tuple[int, ...]) -> None:
    finite = np.isfinite(x)
    if not finite.all():
        bad = int(x.size - np.count_nonzero(finite))
        first = np.unravel_index(int(np.argmin(finite)), want)
        raise FormatError(f"{path}: tensor {name}: {bad} non-finite values (NaN or inf), the first at "
                          f"{tuple(int(i) for i in first)}")


def read_model(path: str | os.PathLike, *, names: Collection[str] | None = None) -> ModelFile:
    """Read a model file written by write_model; every dense tensor checked finite and kept as
    stored (F16, BF16, Q8_0; any other type widened to float32): `dense[name]` widens it to
    float32 on each access (strata.formats.dense_weights). `names`: only those, e.g. a pipeline
    stage's layers."""
    gguf = _gguf()
    gf = open_gguf(path)
    path = gf.path
    try:
        _check_sum(gf)
        cfg = _config(gf)
        # Bound the config by the file before anything is built from it: every layer has tensors
        # of its own, so n_layers = 2**32 - 1 in a file of 29 tensors is refused here, not after
        # dense_tensor_shapes has tried to list four billion layers.
        if cfg.n_layers > len(gf.tensors):
            raise MissingTensorError(f"{path}: {config_key('n_layers')} = {cfg.n_layers}, but the file holds only "
                                     f"{len(gf.tensors)} tensors")
        dense: dict[str, np.ndarray | StoredTensor] = {}
        types: dict[str, Any] = {}
        for name, want in dense_tensor_shapes(cfg).items():
            if names is not None and name not in names:
                continue
            info = gf.tensors.get(name)
            if info is None:
                raise MissingTensorError(f"{path}: missing tensor {name}")
            if info.shape != want:
                raise FormatError(f"{path}: tensor {name}: expected shape {want}, found {info.shape}")
            dense[name] = _dequantize(gf, name, info, want)
            gf.release(gf.data_offset + info.offset, info.nbytes)  # copied out: the map's pages can go
            types[name] = _quant_type(gguf.GGMLQuantizationType(info.ggml_type))
        metadata = {k: f.value for k, f in gf.fields.items() if not k.startswith("GGUF.") and k not in _RESERVED_KEYS}
        return ModelFile(path=path, cfg=cfg, dense=DenseWeights(dense), tokenizer_json=_string_field(gf, KEY_TOKENIZER_JSON),
                         chat_template=_string_field(gf, KEY_CHAT_TEMPLATE, required=False),
                         dense_types=types, metadata=metadata,
                         experts_identity=_string_field(gf, KEY_EXPERTS_IDENTITY, required=False),
                         ngrams_identity=_string_field(gf, KEY_NGRAMS_IDENTITY, required=False))
    finally:
        gf.close()
