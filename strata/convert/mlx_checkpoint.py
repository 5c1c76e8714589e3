"""An MLX-quantized checkpoint (what mlx-lm's `convert -q` writes) read as the float checkpoint it
stands for, with its routed experts available bit for bit.

mlx-lm stores a quantized linear or embedding `p` as `p.weight` (uint32, the packed codes
[rows, cols * bits / 32]), `p.scales` and, for the affine mode, `p.biases` ([rows, cols / group]
in the model's float type); config.json's `quantization` block gives the default
`group_size`, `bits` and `mode` and per-module overrides (`"model.layers.0.mlp.gate":
{"group_size": 64, "bits": 8}`, or `false` for a module left in float). Routed experts are
stacked per layer as `{moe}.switch_mlp.{gate_proj,up_proj,down_proj}` [E, rows, ...].

`MlxCheckpoint` is a `Checkpoint` whose tensors are the logical ones: `p.weight` with its float
shape, read dequantized to float32 (exact: a 16-bit scale times a small integer plus a 16-bit
bias), and no `.scales` / `.biases`. So every family's converter reads it unchanged, and dense
weights are stored as the user asks (--dense). `MlxExpertTensors` reads a routed expert either
as its stored planes (an `ExpertWeights` of strata's type for the same bits: nothing is
requantized) or dequantized (when the user asks for another type).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from strata.convert.common import LAYER
from strata.convert.hf_config import HFConfig
from strata.convert.safetensors_reader import Checkpoint
from strata.errors import ConfigError, FormatError
from strata.formats.expert_record import ExpertWeights
from strata.formats.mlx_affine import affine_type
from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType
from strata.model_config import ModelConfig
from strata.reference.quants import dequantize

QUANT_KEYS = ("quantization", "quantization_config")  # mlx-lm writes both, with the same content
MODES = ("affine", "mxfp4")
SCALE_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "U8": np.dtype(np.uint8)}
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")  # mlx-lm's switch_mlp names for every family


@dataclass(frozen=True)
class QuantParams:
    bits: int
    group_size: int
    mode: str


@dataclass(frozen=True)
class MlxQuantization:
    """config.json's `quantization` block: the default and the per-module overrides."""

    default: QuantParams
    overrides: dict  # module path -> QuantParams, or None for a module left in float

    def of(self, module: str) -> QuantParams | None:
        return self.overrides.get(module, self.default)


# MLX's defaults per mode (`nn.QuantizedLinear.to_quantized`): an override without `mode` is
# affine, and one without bits / group_size takes its mode's defaults, not the top level's
MODE_DEFAULTS = {"affine": (4, 64), "mxfp4": (4, 32)}


def _params(raw: dict, where: str) -> QuantParams:
    mode = str(raw.get("mode", "affine"))
    if mode not in MODES:
        raise ConfigError(f"{where}: quantization mode {mode!r} not supported; supported: {', '.join(MODES)}")
    bits, group = MODE_DEFAULTS[mode]
    try:
        return QuantParams(int(raw.get("bits") or bits), int(raw.get("group_size") or group), mode)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: quantization needs integer bits and group_size, got {raw}") from None


def quantization_of(hf: HFConfig) -> MlxQuantization | None:
    """The MLX quantization of a checkpoint's config, or None for a float checkpoint (or another
    tool's `quantization_config`, which the float path refuses by name)."""
    raw = hf.raw.get("quantization")
    if raw is None:
        q = hf.raw.get("quantization_config")
        raw = q if isinstance(q, dict) and "quant_method" not in q and "bits" in q else None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{hf.path}: quantization must be an object, got {raw!r}")
    default = _params(raw, str(hf.path))
    overrides = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            overrides[key] = _params(value, f"{hf.path}: quantization.{key}")
        elif value is False:
            overrides[key] = None
    return MlxQuantization(default, overrides)


def without_quantization(hf: HFConfig) -> HFConfig:
    """The config with its quantization keys removed: the float model the families read."""
    return dataclasses.replace(hf, raw={k: v for k, v in hf.raw.items() if k not in QUANT_KEYS})


def _strata_type(p: QuantParams, scale_dtype: str, where: str) -> QuantType:
    if p.mode == "mxfp4":
        if (p.bits, p.group_size) != (4, 32):
            raise ConfigError(f"{where}: mxfp4 with bits={p.bits} group_size={p.group_size}; MXFP4 is 4 bits, group 32")
        return QuantType.MXFP4
    if scale_dtype not in ("BF16", "F16"):
        raise ConfigError(f"{where}: scales are {scale_dtype}; strata keeps MLX experts with float16 or bfloat16 "
                          "scales (re-quantize with mlx-lm --dtype bfloat16)")
    try:
        return affine_type(p.bits, p.group_size, scale_dtype == "BF16")
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


class MlxCheckpoint(Checkpoint):
    """A Checkpoint of an MLX-quantized model, seen as its float model (see the module doc)."""

    def __init__(self, directory, quant: MlxQuantization) -> None:
        super().__init__(directory)
        self.quant = quant
        self.raw_tensors = self.tensors
        self.quantized: dict[str, QuantType] = {}  # logical `p.weight` -> its strata type
        for name, info in self.raw_tensors.items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and info.dtype == "U32" and module + ".scales" in self.raw_tensors:
                p = quant.of(module)
                if p is None:
                    raise FormatError(f"{self.directory}: {name} is packed but quantization.{module} says float")
                where = f"{self.directory}: {module}"
                self.quantized[name] = _strata_type(p, self.raw_tensors[module + ".scales"].dtype, where)
        hidden = {n.removesuffix(".weight") + s for n in self.quantized for s in (".scales", ".biases")}
        self.tensors = {n: i for n, i in self.raw_tensors.items() if n not in hidden}

    def _params(self, name: str) -> QuantParams:
        return self.quant.of(name.removesuffix(".weight"))

    def shape(self, name: str) -> tuple[int, ...]:
        info = self.info(name)
        if name not in self.quantized:
            return info.shape
        return (*info.shape[:-1], info.shape[-1] * 32 // self._params(name).bits)

    def check_dtype(self, name: str) -> None:
        if name not in self.quantized:
            super().check_dtype(name)

    def _raw(self, name: str, dtype: np.dtype, index: int | None) -> np.ndarray:
        info = self.raw_tensors[name]
        shape, begin, nbytes = info.shape, info.begin, info.end - info.begin
        if index is not None:
            shape, nbytes = shape[1:], nbytes // info.shape[0]
            begin += index * nbytes
        return np.frombuffer(self._pread(info, begin, nbytes), dtype=dtype).reshape(shape)

    def read_matrix(self, name: str, index: int | None = None) -> QuantMatrix:
        """A quantized 2-D weight (or `weight[index]` of a stacked [E, ...] one) as its stored bytes.

        Shapes: -> QuantMatrix [rows, cols] of the logical shape(name) (without the index axis)
        """
        qtype = self.quantized[name]
        module = name.removesuffix(".weight")
        w = self._raw(name, np.dtype("<u4"), index)
        rows, cols = w.shape[0], w.shape[-1] * 32 // self._params(name).bits
        sdt = SCALE_DTYPES[self.raw_tensors[module + ".scales"].dtype]
        scales = np.ascontiguousarray(self._raw(module + ".scales", sdt, index))
        biases = (np.ascontiguousarray(self._raw(module + ".biases", sdt, index))
                  if module + ".biases" in self.raw_tensors else None)
        if w.ndim != 2:
            raise FormatError(f"{self.directory}: {name}: a {w.ndim}-D packed weight where a matrix is expected")
        try:
            return QuantMatrix(qtype, rows, cols, w.view(np.uint8).reshape(rows, -1), scales, biases)
        except ValueError as e:
            raise FormatError(f"{self.directory}: {module}: {e}") from None

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        if name not in self.quantized:
            return super().read(name, index)
        return dequantize(self.read_matrix(name, index))


class MlxExpertTensors:
    """The routed experts of an MLX checkpoint: `{moe}.switch_mlp.{gate,up,down}_proj` stacks.

    `qtype` is the strata type that holds them exactly (one type for every layer and projection:
    an `.experts` file has one), or None when mlx-lm left them in float."""

    def __init__(self, ckpt: MlxCheckpoint, cfg: ModelConfig, moe: str, projections=None) -> None:
        self._ckpt = ckpt
        self.names = [tuple(LAYER.format(l) + f"{moe}.switch_mlp.{p}.weight" for p in EXPERT_NAMES)
                      for l in range(cfg.n_layers)]
        self.consumed = {n for layer in self.names for n in layer}
        f, d, n_exp = cfg.expert_ffn_size, cfg.hidden_size, cfg.n_experts
        types = set()
        for layer in self.names:
            for name, shape in zip(layer, ((n_exp, f, d), (n_exp, f, d), (n_exp, d, f))):
                if name not in ckpt:
                    raise FormatError(f"{ckpt.directory}: checkpoint has no tensor {name} (mlx-lm's stacked experts)")
                if ckpt.shape(name) != shape:
                    raise FormatError(f"{ckpt.directory}: tensor {name}: shape {list(ckpt.shape(name))}, "
                                      f"expected {list(shape)}")
                ckpt.check_dtype(name)
                types.add((ckpt.quantized.get(name), name))
        self._types = {t: n for t, n in sorted(types, key=lambda tn: tn[1])}  # one example name per type

    @property
    def qtype(self) -> QuantType | None:
        """The one type of every expert projection; a ConfigError if they differ (keeping them needs
        one type: an .experts file has one; an explicit --experts type requantizes instead)."""
        if len(self._types) > 1:
            seen = ", ".join(f"{t.name if t else 'float'} ({n})" for t, n in self._types.items())
            raise ConfigError(f"{self._ckpt.directory}: routed experts in several formats ({seen}); an .experts file "
                              "holds one type: quantize every switch_mlp projection alike, or pass --experts TYPE")
        return next(iter(self._types))

    def read(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dequantized float32 gate [F, D], up [F, D], down [D, F]."""
        return tuple(self._ckpt.read(n, expert) for n in self.names[layer])  # type: ignore[return-value]

    def read_quantized(self, layer: int, expert: int) -> ExpertWeights:
        """The stored planes, bit for bit (qtype must not be None)."""
        return ExpertWeights(*(self._ckpt.read_matrix(n, expert) for n in self.names[layer]))
