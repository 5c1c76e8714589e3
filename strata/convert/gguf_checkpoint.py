"""A llama.cpp GGUF model file read as the Hugging Face checkpoint it was converted from.

The file is opened by strata's own GGUF reader (strata/formats/gguf_file.py), which holds it to
ggml's loader's rules first: a relabelled tensor type, a moved or misaligned offset, truncation or
a changed alignment ends in one FormatError line, never in other weights.
`hf_config_of` turns the GGUF's metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...)
into the config.json keys the families read; `GgufCheckpoint` presents its tensors under the
Hugging Face names (`blk.0.attn_q.weight` -> `model.layers.0.self_attn.q_proj.weight`),
dequantized by strata's reference (ggml's semantics; the `gguf` package's values bit for bit);
`GgufExpertTensors` reads the stacked `blk.L.ffn_{gate,up,down}_exps` experts as their stored blocks, every type as the GGUF holds it
(each ggml type is a strata type: strata/formats/ggml_blocks.py; Q8_0 / Q4_0 split into strata's
planes, the rest whole blocks), a type per layer and projection, or dequantized (when the user asks
for another expert type with --experts, which requantizes); `tokenizer_of` rebuilds a
`tokenizer.json` from the GGUF's byte-level BPE vocabulary.

llama.cpp's converter permutes the rows of Q and K for its `llama` architecture (Mixtral), to
its interleaved rotary order; `read` undoes that so the values are the checkpoint's.

Architectures (ARCHITECTURES, by llama.cpp's `general.architecture`): qwen3moe, qwen2moe, olmoe,
llama (MoE) read by the base keys; deepseek2, glm4moe, minimax-m2 by `_sigmoid_config` (deepseek2's
per-head split `attn_k_b` / `attn_v_b` presented as the checkpoint's kv_b_proj); gpt-oss by
`_gpt_oss_config` (its expert biases read by GgufExpertTensors.read_biases); qwen3next and qwen35moe
by `_qwen3next_config`, their tensors by qwen_hybrid.gguf_tensor_plan. A split GGUF is read from its
first part (convert/gguf_split.py); a fused `ffn_gate_up_exps` as gate and up. `qwen4exp`
(Qwen3.8-Flash-Next) by `_qwen4exp_config`, its tensors by qwen4_exp_gguf.gguf_tensor_plan, its one
n-gram table `per_layer_token_embd` presented as its PLE layer's table and its stored hash
constants read by `qwen4exp_hash_constants`. Anything else, an
unknown gating function, rope scaling or pre-tokenizer is refused in one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.convert.hf_config import HFConfig
from strata.convert.tokenizer_files import TokenizerFiles
from strata.errors import ConfigError, FormatError
from strata.families.qwen4_exp import StoredHashConstants
from strata.formats.expert_record import ExpertBiases, ExpertWeights
from strata.formats import gguf_file
from strata.formats.gguf_file import GGUFFile, TensorInfo
from strata.formats.quant_types import QuantType, row_bytes
from strata.model_config import ModelConfig
from strata.reference.quants import dequantize, from_blocks

GGUF_MAGIC = b"GGUF"
# llama.cpp architecture -> (transformers model_type, MoE block name)
ARCHITECTURES = {"qwen3moe": ("qwen3_moe", "mlp"), "qwen2moe": ("qwen2_moe", "mlp"), "olmoe": ("olmoe", "mlp"),
                 "llama": ("mixtral", "block_sparse_moe"), "deepseek2": ("deepseek_v3", "mlp"),
                 "glm4moe": ("glm4_moe", "mlp"), "minimax-m2": ("minimax_m2", "block_sparse_moe"),
                 "gpt-oss": ("gpt_oss", "mlp"), "qwen3next": ("qwen3_next", "mlp"),
                 "qwen35moe": ("qwen3_5_moe_text", "mlp"), "qwen4exp": ("qwen4_exp_text", "mlp")}
# llama.cpp architectures of families strata runs whose GGUF means another computation than
# strata's: refused by name, with the reason and what to convert instead (none today)
REFUSED_ARCHITECTURES: dict[str, str] = {}
# llama.cpp's graph for these normalizes the top-k weights (qwen3moe) or not (the others; its
# loader's default for deepseek2 where `expert_weights_norm` is absent)
NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "llama": False, "deepseek2": False,
             "glm4moe": False, "minimax-m2": True, "gpt-oss": True,
             "qwen3next": True, "qwen35moe": True, "qwen4exp": True}
PER_LAYER = {  # GGUF suffix -> Hugging Face suffix ("{moe}" the MoE block)
    "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate_inp.weight": "{moe}.gate.weight",
    "ffn_gate_shexp.weight": "{moe}.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "{moe}.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "{moe}.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "{moe}.shared_expert_gate.weight",
}
# the sigmoid-routed families' names, over PER_LAYER: the selection bias, shared experts
# (plural), the dense leading layers' FFN
_SIGMOID_LAYER = {
    "exp_probs_b.bias": "{moe}.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "{moe}.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "{moe}.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "{moe}.shared_experts.down_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# the multi-token-prediction layer llama.cpp keeps after the model's (block_count counts it;
# strata skips it, as transformers does): its own tensors, under their Hugging Face names
_NEXTN_LAYER = {
    "nextn.eh_proj.weight": "eh_proj.weight", "nextn.embed_tokens.weight": "embed_tokens.weight",
    "nextn.enorm.weight": "enorm.weight", "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}
# an architecture's own names, over PER_LAYER: DeepSeek's latent attention (MLA)
ARCH_PER_LAYER = {
    "deepseek2": {
        **_SIGMOID_LAYER,
        "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_q.weight": "self_attn.q_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    },
    # llama.cpp's GLM-4.5 layers name the norm before the MLP post_attention_norm (ATTN_POST_NORM)
    "glm4moe": {**_SIGMOID_LAYER, **_NEXTN_LAYER, "post_attention_norm.weight": "post_attention_layernorm.weight"},
    "minimax-m2": {"exp_probs_b.bias": "{moe}.e_score_correction_bias"},  # the bias on the block
    "gpt-oss": {"attn_sinks.weight": "self_attn.sinks", "attn_output.bias": "self_attn.o_proj.bias",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias"},
}
EXPERT_BIAS_SUFFIXES = ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")  # gpt-oss's, [E, F|D]
# llama.cpp's converter splits DeepSeek's kv_b_proj [H (nope + v), c] per head into k_b
# [H, c, nope] (transposed, for its absorbed attention) and v_b [H, v, c]; the checkpoint's
# kv_b_proj is put back together from the two (exact: rows and columns moved, values dequantized)
SPLIT_KV_B = ("attn_k_b.weight", "attn_v_b.weight", "self_attn.kv_b_proj.weight")
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# llama.cpp's fused alternative to gate and up (its converter's --fuse-gate-up-exps): per expert
# the gate rows, then the up rows, [E, 2F, D]; rows are whole blocks, so each half is kept as stored
FUSED_GATE_UP = "ffn_gate_up_exps.weight"
# ggml type name -> the strata type that keeps it as stored (every ggml weight type has one;
# ggml's MXFP4 / NVFP4 are GGML_MXFP4 / GGML_NVFP4 here, MLX's MXFP4 being another layout)
KEPT = {q.name.removeprefix("GGML_"): q for q in QuantType if q.value < 200}
TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens
# qwen4exp's one n-gram table ([rows, one head's width]) and the Hugging Face name it is presented
# under: the table of its one PLE layer (`{arch}.ple.layers`, 0-based)
PLE_TABLE = "per_layer_token_embd.weight"
PLE_TABLE_HF = "model.layers.{}.ple.ple_embedding.ngram_embedding.weight"


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _reader(path: Path) -> GGUFFile:
    """The file, checked by ggml's loader's rules before a byte of it is used (gguf_file.py): a
    relabelled type, a moved offset, truncation or a changed alignment is one FormatError line;
    the first part of a split GGUF is read with all its parts (gguf_split.py)."""
    from strata.convert.gguf_split import open_split

    return open_split(path)


def _value(reader: GGUFFile, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.value


def _type_name(info: TensorInfo) -> str:
    import gguf

    return gguf.GGMLQuantizationType(info.ggml_type).name


def _dequantize(data: np.ndarray, ggml_type: str, n_cols: int) -> np.ndarray:
    """A tensor's stored data (float arrays, or uint8 rows of blocks) in float32, by
    strata's reference (ggml's `dequantize_row_*`; equal to gguf's own bit for bit)."""
    qtype = KEPT[ggml_type]
    raw = np.ascontiguousarray(data).view(np.uint8)
    return dequantize(from_blocks(qtype, n_cols, raw.reshape(-1, row_bytes(qtype, n_cols))))


class GgufCheckpoint:
    """The tensors of a llama.cpp GGUF under Hugging Face names (the `Checkpoint` interface)."""

    def __init__(self, path: str | Path) -> None:
        self.path = self.directory = Path(path)
        self.reader = _reader(self.path)
        self.arch = _value(self.reader, "general.architecture")
        if self.arch in REFUSED_ARCHITECTURES:
            raise ConfigError(f"{path}: general.architecture = {self.arch!r} not supported: "
                              f"{REFUSED_ARCHITECTURES[self.arch]}")
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"{path}: llama.cpp architecture {self.arch!r} not supported; supported: "
                              f"{', '.join(ARCHITECTURES)}")
        self.model_type, self.moe = ARCHITECTURES[self.arch]
        self.per_layer = {**PER_LAYER, **ARCH_PER_LAYER.get(self.arch, {})}
        self.gguf_tensors = dict(self.reader.tensors)  # name -> TensorInfo, in file order
        self.ple_table: str | None = None  # qwen4exp: the Hugging Face name its n-gram table is read under
        if self.arch == "qwen4exp" and PLE_TABLE in self.gguf_tensors:
            self.ple_table = PLE_TABLE_HF.format(_ple_layer(self))
        self.tensors: dict[str, str] = {}  # Hugging Face name -> GGUF name
        self.split_kv_b: dict[str, tuple[str, str]] = {}  # kv_b_proj -> (its k_b, its v_b) (SPLIT_KV_B)
        k_b, v_b, kv_b = SPLIT_KV_B
        for name in self.gguf_tensors:
            hf = self._hf_name(name)
            if hf is not None:
                self.tensors[hf] = name
            elif self.arch == "deepseek2" and name.startswith("blk.") and name.endswith(k_b):
                layer = name.split(".")[1]
                pair = (name, f"blk.{layer}.{v_b}")
                if pair[1] not in self.gguf_tensors:
                    raise FormatError(f"{self.path}: tensor {name} without its pair {pair[1]} (llama.cpp's split kv_b)")
                self.split_kv_b[f"model.layers.{layer}.{kv_b}"] = pair
            elif self.arch == "deepseek2" and name.startswith("blk.") and name.endswith(v_b):
                if name.replace(v_b, k_b) not in self.gguf_tensors:
                    raise FormatError(f"{self.path}: tensor {name} without its pair {name.replace(v_b, k_b)} "
                                      "(llama.cpp's split kv_b)")
            elif not name.endswith(EXPERT_SUFFIXES + (FUSED_GATE_UP,)) and not (
                    self.arch == "gpt-oss" and name.endswith(EXPERT_BIAS_SUFFIXES)):
                self.tensors[name] = name  # unknown: check_unused names it
        for hf, pair in self.split_kv_b.items():
            if hf in self.tensors:
                raise FormatError(f"{self.path}: both {self.tensors[hf]} and {pair[0]} / {pair[1]}: one kv_b, "
                                  "whole or split, per layer")
            self.tensors[hf] = hf

    def _hf_name(self, name: str) -> str | None:
        if name in GLOBAL:
            return GLOBAL[name]
        if name == PLE_TABLE and self.ple_table is not None:
            return self.ple_table
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self.per_layer:
            return f"model.layers.{parts[1]}." + self.per_layer[parts[2]].format(moe=self.moe)
        return None

    def _split_shapes(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (k_b, v_b) shapes of a split kv_b, checked to be one head split: [H, c, nope], [H, v, c]."""
        k_shape, v_shape = (tuple(int(n) for n in self.gguf_tensors[g].shape) for g in self.split_kv_b[name])
        if len(k_shape) != 3 or len(v_shape) != 3 or k_shape[:2] != (v_shape[0], v_shape[2]):
            raise FormatError(f"{self.path}: tensors {' and '.join(self.split_kv_b[name])}: shapes {list(k_shape)} "
                              f"and {list(v_shape)}, expected [H, c, nope] and [H, v, c]")
        return k_shape, v_shape

    def _read_kv_b(self, name: str) -> np.ndarray:
        """kv_b_proj [H (nope + v), c] from llama.cpp's k_b [H, c, nope] and v_b [H, v, c]."""
        k_shape, v_shape = self._split_shapes(name)
        k_b, v_b = (self._read_gguf(g, s) for g, s in zip(self.split_kv_b[name], (k_shape, v_shape)))
        kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [H, nope + v, c]
        return np.ascontiguousarray(kv.reshape(-1, kv.shape[-1]))

    def _read_gguf(self, gname: str, shape: tuple[int, ...]) -> np.ndarray:
        t = self.gguf_tensors[gname]
        if _type_name(t) not in KEPT:
            raise FormatError(f"{self.path}: tensor {gname}: type {_type_name(t)} is not a weight type "
                              f"(supported: {', '.join(KEPT)})")
        return _dequantize(self.reader.raw(t), _type_name(t), shape[-1]).reshape(shape)

    def key(self, gguf_name: str) -> str:
        """The name `tensors` lists a GGUF tensor under: its Hugging Face name where PER_LAYER /
        GLOBAL map it, else its own (a family's GGUF tensor plan names sources by these)."""
        return self._hf_name(gguf_name) or gguf_name

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.gguf_tensors

    def _tensor(self, name: str):
        gname = self.tensors.get(name, name)
        if gname not in self.gguf_tensors:
            raise FormatError(f"{self.path}: no tensor {name}")
        return self.gguf_tensors[gname]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.split_kv_b:
            (heads, c, nope), (_, v, _) = self._split_shapes(name)
            return heads * (nope + v), c
        return tuple(int(n) for n in self._tensor(name).shape)  # numpy order (ggml's ne reversed)

    def ggml_type(self, name: str) -> int:
        """The tensor's ggml type id (F32 for a kv_b put back together: it is float values)."""
        if name in self.split_kv_b:
            return int(QuantType.F32)
        return int(self._tensor(name).ggml_type)

    def check_dtype(self, name: str) -> None:
        if name in self.split_kv_b:
            for g in self.split_kv_b[name]:
                self.check_dtype(g)
            return
        t = self._tensor(name)
        if _type_name(t) not in KEPT:
            raise FormatError(f"{self.path}: tensor {t.name}: type {_type_name(t)} is not a weight type "
                              f"(supported: {', '.join(KEPT)})")

    def raw(self, name: str, index: int | None = None) -> tuple[str, np.ndarray]:
        """(ggml type name, the stored data: rows of blocks as uint8, or the float array; a
        read-only view of the file's map)."""
        t = self._tensor(name)
        data = self.reader.raw(t)
        return _type_name(t), (data if index is None else data[index])

    def stored(self, name: str) -> tuple[int, np.ndarray]:
        """(ggml type id, the tensor's rows as stored: uint8 [R, row_bytes]) in the Hugging Face row
        order (llama's Q/K rows un-permuted: rows are whole blocks, so that moves bytes only)."""
        self.check_dtype(name)
        t = self._tensor(name)
        shape = self.shape(name)
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        raw = np.ascontiguousarray(self.reader.raw(t)).view(np.uint8).reshape(rows, -1)
        if self.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            raw = self._unpermute(raw, t.name)
        return int(t.ggml_type), raw

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor in float32, in the Hugging Face layout. Shapes: -> shape(name) (without index)"""
        if name in self.split_kv_b and index is None:
            return self._read_kv_b(name)
        self.check_dtype(name)
        t = self._tensor(name)
        data = self.reader.raw(t) if index is None else self.reader.raw(t)[index]
        want = self.shape(name) if index is None else self.shape(name)[1:]
        x = _dequantize(data, _type_name(t), want[-1]).reshape(want)
        if self.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            x = self._unpermute(x, t.name)
        return x

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a 2-D tensor in float32, from the map alone (an n-gram table is
        never read whole). Shapes: -> [stop - start, width]"""
        self.check_dtype(name)
        t = self._tensor(name)
        width = self.shape(name)[-1]
        rows = np.asarray(self.reader.raw(t)).view(np.uint8).reshape(self.shape(name)[0], -1)
        return _dequantize(rows[start:stop], _type_name(t), width).reshape(stop - start, width)

    def _unpermute(self, w: np.ndarray, name: str) -> np.ndarray:
        """Inverse of llama.cpp's `LlamaModel.permute` (rows of each head: [2, half] -> [half, 2])."""
        heads = int(_value(self.reader, "llama.attention.head_count"))
        if name.endswith("attn_k.weight"):
            heads = int(_value(self.reader, "llama.attention.head_count_kv", heads))
        rows, cols = w.shape
        return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.reader = None

    def __enter__(self) -> "GgufCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_REQUIRED = object()
_INTEGERS = frozenset({gguf_file.UINT8, gguf_file.INT8, gguf_file.UINT16, gguf_file.INT16, gguf_file.UINT32,
                       gguf_file.INT32, gguf_file.UINT64, gguf_file.INT64})
_KINDS = {"an integer": _INTEGERS, "a number": _INTEGERS | {gguf_file.FLOAT32, gguf_file.FLOAT64},
          "a string": {gguf_file.STRING}, "a bool": {gguf_file.BOOL}}


def metadata(ckpt: GgufCheckpoint, key: str, kind: str, default=_REQUIRED):
    """The value of metadata `key`, checked to be `kind` (a key of _KINDS); `default` where it is
    absent, or a FormatError naming the key where it is required (as llama.cpp's loader requires
    it) or of another type."""
    f = ckpt.reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise FormatError(f"{ckpt.path}: missing metadata key {key} (llama.cpp's loader requires it)")
        return default
    if f.type not in _KINDS[kind] or (kind == "an integer" and f.value < 0):
        raise FormatError(f"{ckpt.path}: metadata key {key} is {f.type_name} {f.value!r}, expected {kind}")
    return f.value


def _string_list(ckpt: GgufCheckpoint, key: str, default=_REQUIRED) -> list[str]:
    f = ckpt.reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise FormatError(f"{ckpt.path}: missing metadata key {key} (llama.cpp's loader requires it)")
        return default
    if f.type != gguf_file.ARRAY or f.item_type != gguf_file.STRING:
        raise FormatError(f"{ckpt.path}: metadata key {key} is {f.type_name}, expected an array of strings")
    return list(f.value)


def _key_readers(ckpt: GgufCheckpoint, *, as_written: bool = False):
    """(integer, number): readers of `{arch}.KEY` metadata, each `(key, default=required)` and
    checked as `metadata` checks. as_written: a number as the checkpoint's config wrote it:
    llama.cpp stores float32, whose shortest round-trip decimal is the config's number (1e-06, not
    9.99999997e-07); otherwise the stored value as it reads."""
    a = ckpt.arch

    def integer(key: str, default=_REQUIRED):
        return metadata(ckpt, f"{a}.{key}", "an integer", default)

    def number(key: str, default=_REQUIRED):
        value = metadata(ckpt, f"{a}.{key}", "a number", default)
        return float(str(np.float32(value))) if as_written else value

    return integer, number


def _expert_count(ckpt: GgufCheckpoint) -> int:
    """`{arch}.expert_count`, refused in one line where it is missing or 0 (a dense model)."""
    n = metadata(ckpt, f"{ckpt.arch}.expert_count", "an integer", 0)
    if not n:
        raise ConfigError(f"{ckpt.path}: {ckpt.arch}.expert_count is missing or 0: not a Mixture-of-Experts model")
    return n


def hf_config_of(ckpt: GgufCheckpoint) -> HFConfig:
    """The config.json keys the families read, from the GGUF's `{arch}.*` metadata (each checked
    present where llama.cpp requires it, and of its type: one line naming the key otherwise)."""
    if ckpt.arch in ("deepseek2", "glm4moe", "minimax-m2"):
        return _sigmoid_config(ckpt)
    if ckpt.arch == "gpt-oss":
        return _gpt_oss_config(ckpt)
    if ckpt.arch in ("qwen3next", "qwen35moe"):
        return _qwen3next_config(ckpt)
    if ckpt.arch == "qwen4exp":
        return _qwen4exp_config(ckpt)
    a = ckpt.arch
    integer, number = _key_readers(ckpt)
    n_experts = _expert_count(ckpt)
    scaling = metadata(ckpt, f"{a}.rope.scaling.type", "a string", "none")
    if scaling != "none":
        raise ConfigError(f"{ckpt.path}: {a}.rope.scaling.type = {scaling!r}; supported: none")
    vocab = ckpt.shape("model.embed_tokens.weight")[0]
    ffn = integer("expert_feed_forward_length", None)
    ffn = integer("feed_forward_length") if ffn is None else ffn
    heads = integer("attention.head_count")
    raw = dict(
        model_type=ckpt.model_type, vocab_size=vocab, hidden_size=integer("embedding_length"),
        num_hidden_layers=integer("block_count"), num_attention_heads=heads,
        num_key_value_heads=integer("attention.head_count_kv", heads),
        head_dim=integer("attention.key_length", None), num_experts=n_experts, num_local_experts=n_experts,
        num_experts_per_tok=integer("expert_used_count"), moe_intermediate_size=ffn, intermediate_size=ffn,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon"), rope_theta=number("rope.freq_base", 10000.0),
        max_position_embeddings=integer("context_length"), hidden_act="silu",
        norm_topk_prob=bool(metadata(ckpt, f"{a}.expert_weights_norm", "a bool", NORM_TOPK[a])),
        tie_word_embeddings="output.weight" not in ckpt.gguf_tensors,
    )
    shared = integer("expert_shared_feed_forward_length", None)
    if shared:
        raw["shared_expert_intermediate_size"] = shared
    return HFConfig(ckpt.path, {k: v for k, v in raw.items() if v is not None})


# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*: the router's scores
GATING_SOFTMAX, GATING_SIGMOID = 1, 2
YARN_LOG_MUL_PER_MSCALE = 0.1  # llama.cpp's converter writes yarn_log_multiplier = 0.1 * mscale_all_dim
# gpt-oss's clamped SwiGLU as llama.cpp's graph fixes it (LLM_FFN_SWIGLU_OAI_MOE; not in the file)
LLAMA_CPP_SWIGLU_ALPHA, LLAMA_CPP_SWIGLU_LIMIT = 1.702, 7.0


def _sigmoid_config(ckpt: GgufCheckpoint) -> HFConfig:
    """The sigmoid-routed families as llama.cpp writes them, as their config.json keys:
    `deepseek2` (DeepSeek-V3 / Kimi-K2 / GLM-4.7-Flash, as deepseek_v3), `glm4moe` (GLM-4.5 /
    4.6 / 4.7) and `minimax-m2` (rope.dimension_count its rotary_dim, its q/k norms over the whole
    projection; gating absent means sigmoid, its only one). Routing: `expert_gating_func` (2: sigmoid; 1 or absent: softmax, refused),
    `expert_weights_scale`, `expert_weights_norm`, `expert_group_count` / `expert_group_used_count`
    (absent: one group, as llama.cpp runs it), `expert_shared_count`, `leading_dense_block_count`.
    deepseek2's MLA keys come in two generations: today's (head_count_kv 1, key_length =
    kv_lora_rank + rope, key_length_mla = nope + rope, value_length_mla = v) and the first
    (head_count_kv = heads, key_length = nope + rope, value_length = v); both are read. glm4moe:
    block_count counts the multi-token-prediction layers after the model's (`nextn_predict_layers`,
    skipped), partial rotary is rope.dimension_count of key_length, q/k norms and q/k/v biases are
    there when their tensors are. A rope scaling other than none (and yarn for deepseek2) is refused
    in one line naming the key."""
    a = ckpt.arch
    integer, number = _key_readers(ckpt, as_written=True)

    n_experts = _expert_count(ckpt)
    # absent: DeepSeek-V2's softmax for deepseek2 (llama.cpp's default); MiniMax-M2 has only sigmoid
    gating = integer("expert_gating_func", None)
    if gating is None and a == "deepseek2":
        # llama.cpp's converter writes the key only where config.json names `scoring_func`
        # (DeepSeek-V3's own does; a config saved by transformers 5 drops it)
        raise ConfigError(f"{ckpt.path}: {a}.expert_gating_func is absent, which llama.cpp reads as softmax scores "
                          f"(DeepSeek-V2); supported: {GATING_SIGMOID} (sigmoid): convert the checkpoint again with "
                          '"scoring_func": "sigmoid" in its config.json')
    gating = GATING_SIGMOID if gating is None else gating
    if gating != GATING_SIGMOID:
        raise ConfigError(f"{ckpt.path}: {a}.expert_gating_func = {gating} (softmax scores: DeepSeek-V2); "
                          f"supported: {GATING_SIGMOID} (sigmoid)")
    heads = integer("attention.head_count")
    rope = integer("rope.dimension_count")
    layers = integer("block_count")
    raw = dict(
        model_type=ckpt.model_type, vocab_size=ckpt.shape("model.embed_tokens.weight")[0],
        hidden_size=integer("embedding_length"), num_attention_heads=heads, n_routed_experts=n_experts,
        num_experts_per_tok=integer("expert_used_count"), moe_intermediate_size=integer("expert_feed_forward_length"),
        intermediate_size=integer("feed_forward_length"), rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
        rope_theta=number("rope.freq_base", 10000.0), max_position_embeddings=integer("context_length"),
        hidden_act="silu", first_k_dense_replace=integer("leading_dense_block_count", 0),
        n_shared_experts=integer("expert_shared_count", 0), routed_scaling_factor=number("expert_weights_scale", 1.0),
        norm_topk_prob=bool(metadata(ckpt, f"{a}.expert_weights_norm", "a bool", NORM_TOPK[a])),
        n_group=integer("expert_group_count", 1), topk_group=integer("expert_group_used_count", 1),
        scoring_func="sigmoid", topk_method="noaux_tc",
        tie_word_embeddings="output.weight" not in ckpt.gguf_tensors,
    )
    if a == "deepseek2":
        key = integer("attention.key_length_mla", None)
        key = integer("attention.key_length") if key is None else key
        value = integer("attention.value_length_mla", None)
        value = integer("attention.value_length") if value is None else value
        if key <= rope:
            raise FormatError(f"{ckpt.path}: {a}.attention.key_length(_mla) = {key} is not more than "
                              f"{a}.rope.dimension_count = {rope} (nope + rope per head)")
        raw.update(num_hidden_layers=layers, num_key_value_heads=heads,
                   q_lora_rank=integer("attention.q_lora_rank", 0) or None, kv_lora_rank=integer("attention.kv_lora_rank"),
                   qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=value, rope_interleave=True)
    elif a == "minimax-m2":  # no shared expert, no dense layer, no groups: refused where a key says otherwise
        for key in ("expert_shared_count", "leading_dense_block_count"):
            if integer(key, 0):
                raise ConfigError(f"{ckpt.path}: {a}.{key} = {integer(key)}; supported: 0 (MiniMax-M2)")
        raw.update(num_hidden_layers=layers, num_key_value_heads=integer("attention.head_count_kv", heads),
                   head_dim=integer("attention.key_length", raw["hidden_size"] // heads), rotary_dim=rope,
                   num_local_experts=n_experts, intermediate_size=raw["moe_intermediate_size"])
    else:  # glm4moe
        head_dim = integer("attention.key_length", raw["hidden_size"] // heads)
        nextn = integer("nextn_predict_layers", 0)
        if nextn >= layers:
            raise FormatError(f"{ckpt.path}: {a}.nextn_predict_layers = {nextn} is not less than {a}.block_count = {layers}")
        raw.update(num_hidden_layers=layers - nextn, num_key_value_heads=integer("attention.head_count_kv", heads),
                   head_dim=head_dim, partial_rotary_factor=rope / head_dim,
                   use_qk_norm="blk.0.attn_q_norm.weight" in ckpt.gguf_tensors,
                   attention_bias="blk.0.attn_q.bias" in ckpt.gguf_tensors)
    scaling = metadata(ckpt, f"{a}.rope.scaling.type", "a string", "none")
    if scaling == "yarn" and a == "deepseek2":  # llama.cpp keeps one mscale (yarn_log_multiplier): mscale = mscale_all_dim
        mscale = number("rope.scaling.yarn_log_multiplier", 0.0) / YARN_LOG_MUL_PER_MSCALE
        raw["rope_scaling"] = dict(rope_type="yarn", factor=number("rope.scaling.factor"),
                                   original_max_position_embeddings=integer("rope.scaling.original_context_length"),
                                   mscale=mscale, mscale_all_dim=mscale,
                                   beta_fast=number("rope.scaling.yarn_beta_fast", 32.0),
                                   beta_slow=number("rope.scaling.yarn_beta_slow", 1.0))
    elif scaling != "none":
        supported = "none, yarn" if a == "deepseek2" else "none"
        raise ConfigError(f"{ckpt.path}: {a}.rope.scaling.type = {scaling!r}; supported: {supported}")
    return HFConfig(ckpt.path, {k: v for k, v in raw.items() if v is not None})


def _gpt_oss_config(ckpt: GgufCheckpoint) -> HFConfig:
    """gpt-oss as llama.cpp's `gpt-oss` writes it, as its config.json keys: the base keys,
    `attention.sliding_window` (llama.cpp runs every even layer windowed, as the released
    `layer_types` say), expert_feed_forward_length, YaRN from `rope.scaling.*` (beta fast / slow
    its defaults 32 / 1 where absent; llama.cpp's correction range is truncated to whole dims,
    transformers' `truncate` true). The clamped SwiGLU's alpha and limit are not in the file:
    llama.cpp's graph fixes them at 1.702 and 7.0, and so are they here."""
    a = ckpt.arch
    integer, number = _key_readers(ckpt, as_written=True)

    n_experts = _expert_count(ckpt)
    heads, layers = integer("attention.head_count"), integer("block_count")
    head_dim = integer("attention.key_length")
    rope = integer("rope.dimension_count", head_dim)
    if rope != head_dim:
        raise ConfigError(f"{ckpt.path}: {a}.rope.dimension_count = {rope}; supported: {head_dim} "
                          f"({a}.attention.key_length: rotary over the whole head)")
    rope_parameters = dict(rope_type="default", rope_theta=number("rope.freq_base", 150000.0))
    scaling = metadata(ckpt, f"{a}.rope.scaling.type", "a string", "none")
    if scaling == "yarn":
        rope_parameters.update(rope_type="yarn", factor=number("rope.scaling.factor"),
                               original_max_position_embeddings=integer("rope.scaling.original_context_length"),
                               beta_fast=number("rope.scaling.yarn_beta_fast", 32.0),
                               beta_slow=number("rope.scaling.yarn_beta_slow", 1.0), truncate=True)
    elif scaling != "none":
        raise ConfigError(f"{ckpt.path}: {a}.rope.scaling.type = {scaling!r}; supported: none, yarn")
    raw = dict(
        model_type=ckpt.model_type, vocab_size=ckpt.shape("model.embed_tokens.weight")[0],
        hidden_size=integer("embedding_length"), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=integer("attention.head_count_kv", heads), head_dim=head_dim,
        num_local_experts=n_experts, num_experts_per_tok=integer("expert_used_count"),
        intermediate_size=integer("expert_feed_forward_length"), rms_norm_eps=number("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=integer("context_length"), sliding_window=integer("attention.sliding_window"),
        layer_types=["sliding_attention" if l % 2 == 0 else "full_attention" for l in range(layers)],
        rope_parameters=rope_parameters, swiglu_alpha=LLAMA_CPP_SWIGLU_ALPHA, swiglu_limit=LLAMA_CPP_SWIGLU_LIMIT,
        attention_bias="blk.0.attn_q.bias" in ckpt.gguf_tensors,
        tie_word_embeddings="output.weight" not in ckpt.gguf_tensors,
    )
    return HFConfig(ckpt.path, raw)


def _qwen3next_config(ckpt: GgufCheckpoint) -> HFConfig:
    """Qwen3-Next (`qwen3next`) and Qwen3.5 / 3.6-MoE (`qwen35moe`) as llama.cpp writes them, as
    their config.json keys: the base keys, the
    gated DeltaNet's `ssm.*` (conv_kernel the conv width, state_size the key head dim, group_count
    the key heads, time_step_rank the value heads, inner_size value heads x value head dim),
    `full_attention_interval`, rope.dimension_count / key_length the partial rotary factor, the
    shared expert's width. Qwen3.5's `rope.dimension_sections` (MRoPE) are not read: a text
    token has one position in all sections, plain RoPE. The tensors are read by strata's hybrid
    plan for GGUF (convert/qwen_hybrid.py `gguf_tensor_plan`)."""
    a = ckpt.arch
    integer, number = _key_readers(ckpt, as_written=True)

    n_experts = _expert_count(ckpt)
    scaling = metadata(ckpt, f"{a}.rope.scaling.type", "a string", "none")
    if scaling != "none":
        raise ConfigError(f"{ckpt.path}: {a}.rope.scaling.type = {scaling!r}; supported: none")
    heads = integer("attention.head_count")
    head_dim = integer("attention.key_length")
    v_heads = integer("ssm.time_step_rank")
    inner = integer("ssm.inner_size")
    if not v_heads or inner % v_heads:
        raise FormatError(f"{ckpt.path}: {a}.ssm.inner_size = {inner} is not a multiple of "
                          f"{a}.ssm.time_step_rank = {v_heads} (value heads x value head dim)")
    raw = dict(
        model_type=ckpt.model_type, vocab_size=ckpt.shape("model.embed_tokens.weight")[0],
        hidden_size=integer("embedding_length"), num_hidden_layers=integer("block_count"),
        num_attention_heads=heads, num_key_value_heads=integer("attention.head_count_kv", heads), head_dim=head_dim,
        num_experts=n_experts, num_experts_per_tok=integer("expert_used_count"),
        moe_intermediate_size=integer("expert_feed_forward_length"),
        shared_expert_intermediate_size=integer("expert_shared_feed_forward_length"),
        rms_norm_eps=number("attention.layer_norm_rms_epsilon"), rope_theta=number("rope.freq_base", 10000.0),
        partial_rotary_factor=integer("rope.dimension_count") / head_dim,
        max_position_embeddings=integer("context_length"), hidden_act="silu",
        full_attention_interval=integer("full_attention_interval", 4),
        linear_conv_kernel_dim=integer("ssm.conv_kernel"), linear_key_head_dim=integer("ssm.state_size"),
        linear_num_key_heads=integer("ssm.group_count"), linear_num_value_heads=v_heads,
        linear_value_head_dim=inner // v_heads,
        norm_topk_prob=bool(metadata(ckpt, f"{a}.expert_weights_norm", "a bool", NORM_TOPK[a])),
        tie_word_embeddings="output.weight" not in ckpt.gguf_tensors,
    )
    return HFConfig(ckpt.path, raw)


@dataclass(frozen=True)
class StackedSlice:
    """One projection of one expert in a stacked tensor: expert e's bytes are
    [offset + e * stride, + nbytes) of tensor `name`'s data, whole rows of `qtype` blocks of
    `cols` weights each."""

    name: str
    offset: int
    stride: int
    nbytes: int
    qtype: QuantType
    cols: int


def _int_list(ckpt: GgufCheckpoint, key: str, *, scalar_ok: bool = False, default=_REQUIRED) -> list[int] | None:
    """The integer (or bool) array at metadata `key`; scalar_ok: a single integer is taken as it is
    (llama.cpp's get_key_or_arr), returned as a one-entry list."""
    f = ckpt.reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise FormatError(f"{ckpt.path}: missing metadata key {key} (llama.cpp's loader requires it)")
        return default
    if scalar_ok and f.type in _INTEGERS:
        return [int(f.value)]
    if f.type != gguf_file.ARRAY or f.item_type not in _INTEGERS | {gguf_file.BOOL}:
        raise FormatError(f"{ckpt.path}: metadata key {key} is {f.type_name}, expected an array of integers")
    values = [int(v) for v in f.value]
    if any(v < 0 for v in values):
        raise FormatError(f"{ckpt.path}: metadata key {key} holds a negative entry")
    return values


def _ple_layer(ckpt: GgufCheckpoint) -> int:
    """qwen4exp's one PLE layer (0-based), from `{arch}.ple.layers` (llama.cpp's loader holds one set
    of hash constants, so it refuses several, and so does this)."""
    layers = _int_list(ckpt, f"{ckpt.arch}.ple.layers")
    if len(layers) != 1:
        raise FormatError(f"{ckpt.path}: {ckpt.arch}.ple.layers lists {len(layers)} layers; a qwen4exp file "
                          "holds one PLE layer (one n-gram table, one set of hash constants)")
    return layers[0]


def qwen4exp_hash_constants(ckpt: GgufCheckpoint, ngram_size: int, heads: int) -> StoredHashConstants:
    """The n-gram hash constants a qwen4exp file stores (UINT64 arrays `{arch}.ple.layer_multipliers`
    [ngram_size], `ple.head_vocab_sizes` and `ple.head_offsets` [heads]), each of exactly that length."""
    a = ckpt.arch
    values = {}
    for key, n in (("layer_multipliers", ngram_size), ("head_vocab_sizes", heads), ("head_offsets", heads)):
        got = _int_list(ckpt, f"{a}.ple.{key}")
        if len(got) != n:
            raise FormatError(f"{ckpt.path}: {a}.ple.{key} has {len(got)} entries, expected {n}")
        values[key] = np.asarray(got, np.int64) if max(got) < 1 << 63 else None
        if values[key] is None:
            raise FormatError(f"{ckpt.path}: {a}.ple.{key} holds an entry of 2^63 or more")
    return StoredHashConstants(values["layer_multipliers"], values["head_vocab_sizes"], values["head_offsets"])


def _qwen4exp_config(ckpt: GgufCheckpoint) -> HFConfig:
    """Qwen3.8-Flash-Next (`qwen4exp`) as llama.cpp writes it, as `qwen4_exp_text` config.json keys:
    the `qwen35moe` keys (_qwen3next_config) and the layer pattern (`attention.recurrent_layers`,
    else `full_attention_interval`), `nextn_predict_layers` (the MTP block after the model's,
    skipped), `hyper_connection.count` / `low_rank`, `attention.indexer.head_count` / `key_length` /
    `top_k`, `attention.compress_ratios` (the indexer's block per layer; 0: dense attention, which
    strata's Qwen4-Exp does not compute: refused), the PLE keys (`ple.layers`, one layer;
    `ngram_size`, `heads_per_ngram`, `conv_kernel`, `eos_token_id`; `embedding_length_per_layer_input`
    one head's row width), and `output_gate_type` "sigmoid": llama.cpp's graph gates the DeltaNet
    output with sigmoid, fixed (no key). The hash constants are read by qwen4exp_hash_constants."""
    a = ckpt.arch
    integer, _ = _key_readers(ckpt)
    raw = dict(_qwen3next_config(ckpt).raw)
    nextn = integer("nextn_predict_layers", 0)
    blocks = raw["num_hidden_layers"]
    if nextn >= blocks:
        raise FormatError(f"{ckpt.path}: {a}.nextn_predict_layers = {nextn} is not less than {a}.block_count = {blocks}")
    n = blocks - nextn
    recurrent = _int_list(ckpt, f"{a}.attention.recurrent_layers", default=None)
    if recurrent is not None:
        if len(recurrent) < n:
            raise FormatError(f"{ckpt.path}: {a}.attention.recurrent_layers has {len(recurrent)} entries, "
                              f"expected {blocks}")
        linear = [bool(r) for r in recurrent[:n]]
    else:
        every = raw.pop("full_attention_interval")
        if every <= 0:
            raise FormatError(f"{ckpt.path}: {a}.full_attention_interval must be greater than zero, got {every}")
        linear = [(i + 1) % every != 0 for i in range(n)]
    raw.pop("full_attention_interval", None)
    ratios = _int_list(ckpt, f"{a}.attention.compress_ratios", scalar_ok=True, default=[0])
    ratios = ratios * blocks if len(ratios) == 1 else ratios
    if len(ratios) < n:
        raise FormatError(f"{ckpt.path}: {a}.attention.compress_ratios has {len(ratios)} entries, expected {blocks}")
    blocks_of = {ratios[i] for i in range(n) if not linear[i]}
    if 0 in blocks_of:
        dense = next(i for i in range(n) if not linear[i] and ratios[i] == 0)
        raise ConfigError(f"{ckpt.path}: {a}.attention.compress_ratios is 0 at attention layer {dense}: dense "
                          "attention, which llama.cpp runs where the checkpoint said `indexed_attention` (its "
                          "converter writes a ratio only for `full_attention` layers); strata's Qwen4-Exp computes "
                          "its attention layers indexed (QSA): convert the Hugging Face checkpoint")
    if len(blocks_of) > 1:
        raise ConfigError(f"{ckpt.path}: {a}.attention.compress_ratios differ between attention layers "
                          f"({sorted(blocks_of)}); supported: one indexer block")
    raw.update(
        num_hidden_layers=n, hidden_act="silu", output_gate_type="sigmoid", norm_topk_prob=NORM_TOPK[a],
        layer_types=["linear_attention" if lin else "full_attention" for lin in linear],
        hc_count=integer("hyper_connection.count"), hc_lowrank=integer("hyper_connection.low_rank"),
        indexer_n_heads=integer("attention.indexer.head_count"), indexer_kv_heads=1,
        indexer_head_dim=integer("attention.indexer.key_length"), indexer_budget=integer("attention.indexer.top_k"),
    )
    if blocks_of:
        raw["indexer_compress_ratio"] = blocks_of.pop()
    if f"{a}.ple.layers" in ckpt.reader.fields:
        ngram, per_order = integer("ple.ngram_size"), integer("ple.heads_per_ngram")
        raw.update(ple_layer_ids=[_ple_layer(ckpt) + 1],  # transformers numbers them from 1
                   ngram_size=ngram, heads_per_ngram=per_order, ple_conv_kernel_size=integer("ple.conv_kernel"),
                   ple_embed_dim=integer("embedding_length_per_layer_input") * (ngram - 1) * per_order,
                   eos_token_id=integer("ple.eos_token_id"))
    return HFConfig(ckpt.path, raw)


class GgufExpertTensors:
    """The stacked experts of a GGUF, kept as stored: `layer_qtypes[l]` is the (gate, up, down)
    strata types of MoE layer l, `qtype` their one type where every projection of every layer
    shares it (else None: the `.experts` file records a type per layer and projection)."""

    def __init__(self, ckpt: GgufCheckpoint, cfg: ModelConfig, moe: str = "", projections=None) -> None:
        self._ckpt = ckpt
        self.names = [tuple(f"blk.{l}.{s}" for s in EXPERT_SUFFIXES) for l in cfg.moe_layers]
        self.consumed: set[str] = set()
        f, d, n_exp = cfg.expert_ffn_size, cfg.hidden_size, cfg.n_experts
        self._ffn = f
        # MoE layers whose gate and up are one fused tensor (FUSED_GATE_UP): names[l] = (fused, fused, down)
        self.fused: set[int] = set()
        for i, l in enumerate(cfg.moe_layers):
            fused = f"blk.{l}.{FUSED_GATE_UP}"
            if fused in ckpt.gguf_tensors:
                if self.names[i][0] in ckpt.gguf_tensors or self.names[i][1] in ckpt.gguf_tensors:
                    raise FormatError(f"{ckpt.path}: both {fused} and {self.names[i][0]} / {self.names[i][1]}: "
                                      "one gate/up per layer, fused or not")
                self.fused.add(i)
                self.names[i] = (fused, fused, self.names[i][2])
        layer_qtypes = []
        for i, layer in enumerate(self.names):
            kinds = []
            gate_up = (n_exp, 2 * f, d) if i in self.fused else (n_exp, f, d)
            for name, shape in zip(layer, (gate_up, gate_up, (n_exp, d, f))):
                if name not in ckpt.gguf_tensors:
                    raise FormatError(f"{ckpt.path}: no tensor {name} (llama.cpp's stacked experts)")
                if ckpt.shape(name) != shape:
                    raise FormatError(f"{ckpt.path}: tensor {name}: shape {list(ckpt.shape(name))}, expected {list(shape)}")
                ckpt.check_dtype(name)
                kinds.append(KEPT[_type_name(ckpt.gguf_tensors[name])])
            layer_qtypes.append(tuple(kinds))
        self.layer_qtypes: tuple[tuple[QuantType, QuantType, QuantType], ...] = tuple(layer_qtypes)
        types = {q for t in self.layer_qtypes for q in t}
        self.source_types = sorted(q.name.removeprefix("GGML_") for q in types)
        self.qtype: QuantType | None = next(iter(types)) if len(types) == 1 else None

    def read_biases(self, layer: int, expert: int) -> ExpertBiases:
        """gpt-oss's expert biases, `blk.L.ffn_{gate,up,down}_exps.bias` [E, F | D] (float32)."""
        out = []
        for name in (n.removesuffix(".weight") + ".bias" for n in self.names[layer]):
            if name not in self._ckpt.gguf_tensors:
                raise FormatError(f"{self._ckpt.path}: no tensor {name} (gpt-oss's expert biases)")
            t = self._ckpt.gguf_tensors[name]
            shape = tuple(int(n) for n in t.shape)
            out.append(np.ascontiguousarray(self._ckpt._read_gguf(name, shape)[expert]))
        return ExpertBiases(*out)

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """gguf's dequantization: gate [F, D], up [F, D], down [D, F] float32."""
        if layer in self.fused:
            gate_up = self._ckpt.read(self.names[layer][0], expert)
            return gate_up[:self._ffn], gate_up[self._ffn:], self._ckpt.read(self.names[layer][2], expert)
        return tuple(self._ckpt.read(n, expert) for n in self.names[layer])  # type: ignore[return-value]

    def slices(self, layer: int) -> tuple[StackedSlice, StackedSlice, StackedSlice]:
        """Where each projection (gate, up, down) of an expert of MoE layer `layer` is in its
        stacked tensor: the one map of a GGUF's expert bytes, which the conversion copies
        (`read_quantized`) and the in-place run reads (strata/convert/gguf_in_place.py)."""
        out = []
        for part, (name, qtype) in enumerate(zip(self.names[layer], self.layer_qtypes[layer])):
            rows, cols = self._ckpt.shape(name)[-2:]  # [E, R, C]: expert e is the e-th of E runs of R rows
            row = row_bytes(qtype, cols)
            if layer in self.fused and part < 2:  # the gate half, then the up half (whole rows of blocks)
                out.append(StackedSlice(name, part * self._ffn * row, rows * row, self._ffn * row, qtype, cols))
            else:
                out.append(StackedSlice(name, 0, rows * row, rows * row, qtype, cols))
        return tuple(out)

    def bias_slices(self, layer: int) -> tuple[StackedSlice, StackedSlice, StackedSlice]:
        """gpt-oss's expert biases `blk.L.ffn_{gate,up,down}_exps.bias` [E, F | D] as stored, for
        a reader that takes their bytes as they are: F32 only (llama.cpp writes them so)."""
        if layer in self.fused:
            raise FormatError(f"{self._ckpt.path}: MoE layer {layer}: expert biases with a fused gate/up tensor")
        out = []
        for name in (n.removesuffix(".weight") + ".bias" for n in self.names[layer]):
            if name not in self._ckpt.gguf_tensors:
                raise FormatError(f"{self._ckpt.path}: no tensor {name} (gpt-oss's expert biases)")
            t = self._ckpt.gguf_tensors[name]
            if t.ggml_type != int(QuantType.F32):
                raise FormatError(f"{self._ckpt.path}: tensor {name} is {_type_name(t)}; expert biases are read in "
                                  f"place as F32 only: run `strata convert {self._ckpt.path} OUT`")
            n = int(t.shape[-1])
            out.append(StackedSlice(name, 0, 4 * n, 4 * n, QuantType.F32, n))
        return tuple(out)

    def read_quantized(self, layer: int, expert: int) -> ExpertWeights:
        """The stored blocks as strata's, each projection its own type (ggml's blocks are strata's
        `to_blocks` form of the same type: split into planes for Q8_0 / Q4_0, whole otherwise)."""
        mats = []
        for s in self.slices(layer):
            _, data = self._ckpt.raw(s.name)
            flat = np.ascontiguousarray(data).view(np.uint8).reshape(-1)  # the map's bytes, no copy
            start = s.offset + expert * s.stride
            mats.append(from_blocks(s.qtype, s.cols, flat[start:start + s.nbytes]))
        return ExpertWeights(*mats)


# ---------------------------------------------------------------- tokenizer

# tokenizer.ggml.pre -> the pre-tokenizer split regexes of the Hugging Face tokenizer it came from,
# applied in turn (each splits the pieces of the one before, isolating its matches, as llama.cpp's
# `unicode_regex_split` over its list in src/llama-vocab.cpp), then byte-level; None: ByteLevel's own
# regex (GPT-2's). Where llama.cpp rewrote a regex for its engine (case-insensitive groups spelled
# out, \p{Lu}-style classes as look-aheads) the Hugging Face original it stands for is used.
_GPT2 = None
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+",)
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+",)
# llama 3's, digits in runs of up to three: GLM-4.5 / 4.6 / 4.7 (`glm4`, `chatglm-bpe`)
_CHATGLM4 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",)
# DeepSeek-V3 / R1: digits in runs of up to three, CJK runs, then the word regex
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-oss's `gpt-4o`, MiniMax-M2's `minimax-m2`): case runs split, contractions kept on the word
_O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",)
# "gpt-2" is llama.cpp's own name for GPT-2's (its converter writes it, its loader knows no "gpt2")
PRE_TOKENIZERS = {"gpt2": _GPT2, "gpt-2": _GPT2, "default": _GPT2, "olmo": _GPT2, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
                  "qwen35": _QWEN35, "glm4": _CHATGLM4, "chatglm-bpe": _CHATGLM4, "deepseek-v3": _DEEPSEEK3,
                  "gpt-4o": _O200K, "minimax-m2": _O200K}


def pre_tokenizer(pre: str):
    """The Hugging Face pre-tokenizer of llama.cpp's `tokenizer.ggml.pre` value (a key of PRE_TOKENIZERS)."""
    from tokenizers import Regex, pre_tokenizers

    regexes = PRE_TOKENIZERS[pre]
    if regexes is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_of(ckpt: GgufCheckpoint) -> TokenizerFiles:
    """A tokenizer.json rebuilt from the GGUF's byte-level BPE (`tokenizer.ggml.model` gpt2)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    r = ckpt.reader
    kind = metadata(ckpt, "tokenizer.ggml.model", "a string", None)
    if kind != "gpt2":
        raise ConfigError(f"{ckpt.path}: tokenizer.ggml.model = {kind!r}; supported: 'gpt2' (byte-level BPE)")
    pre = metadata(ckpt, "tokenizer.ggml.pre", "a string", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"{ckpt.path}: tokenizer.ggml.pre = {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}")
    tokens = _string_list(ckpt, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _string_list(ckpt, "tokenizer.ggml.merges")]  # gpt2 BPE needs them
    if any(len(m) != 2 for m in merges):
        raise FormatError(f"{ckpt.path}: tokenizer.ggml.merges holds an entry without a space (want 'a b')")
    f = r.fields.get("tokenizer.ggml.token_type")
    if f is not None and (f.type != gguf_file.ARRAY or f.item_type not in _INTEGERS or len(f.value) != len(tokens)):
        raise FormatError(f"{ckpt.path}: tokenizer.ggml.token_type is {f.type_name} of {len(f.value) if f.type == gguf_file.ARRAY else 1}, "
                          f"expected {len(tokens)} integers (one per token)")
    types = list(f.value) if f is not None else [1] * len(tokens)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL])
    special = {}
    for name in ("bos", "eos", "unk", "pad"):
        idx = metadata(ckpt, f"tokenizer.ggml.{name}_token_id", "an integer", None)
        if idx is not None and 0 <= int(idx) < len(tokens):
            special[f"{name}_token"] = tokens[int(idx)]
    return TokenizerFiles(tok.to_str(), len(tokens), metadata(ckpt, "tokenizer.chat_template", "a string", None), special)
