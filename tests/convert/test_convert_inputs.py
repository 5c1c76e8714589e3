"""What `strata convert` accepts and refuses: config spellings, expert layouts, bad input.

Every refusal is one line (`error: ...` from the CLI, exit status 2) and writes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: it reads it once
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers")

from strata.cli.main import main  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.convert.architectures import family_for  # noqa: E402
from strata.convert.hf_config import HFConfig  # noqa: E402
from strata.convert.safetensors_reader import Checkpoint  # noqa: E402
from strata.formats.experts_file import ExpertsFile  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.model_config import ModelConfig  # noqa: E402
from tests import hf_models  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {a: hf_models.cached_checkpoint(a, tmp_path_factory)[0] for a in ("qwen3_moe", "qwen2_moe", "mixtral")}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


_DELETE = object()


def _model_config(d: Path) -> ModelConfig:
    hf = HFConfig.read(d)
    with Checkpoint(d) as ckpt:
        return family_for(hf).model_config(hf, ckpt)


def _cli_error(capsys, hf_dir: Path, out: Path, *extra: str) -> str:
    """Run `strata convert`, expect a one-line error and no output files; return the line."""
    capsys.readouterr()  # drop what building the checkpoint printed
    rc = main(["convert", str(hf_dir), str(out), "--quiet", *extra])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not list(out.parent.glob(out.name + "*"))
    return lines[0]


# ---------------------------------------------------------------- config spellings


def test_both_config_spellings_give_one_model_config(ckpts, tmp_path):
    """transformers 5 writes rope_parameters and (for Qwen3) num_local_experts; the Hub's v4
    configs have rope_theta + rope_scaling and num_experts."""
    v5 = _copy(ckpts["qwen3_moe"], tmp_path / "v5")
    _edit_config(v5, rope_parameters={"rope_type": "default", "rope_theta": 123456.0}, rope_theta=_DELETE,
                 num_experts=_DELETE, num_local_experts=hf_models.EXPERTS)
    v4 = _copy(ckpts["qwen3_moe"], tmp_path / "v4")
    _edit_config(v4, rope_parameters=_DELETE, rope_theta=123456.0, rope_scaling=None,
                 num_local_experts=_DELETE, num_experts=hf_models.EXPERTS)
    a, b = _model_config(v5), _model_config(v4)
    assert a == b
    assert (a.rope_theta, a.n_experts, a.norm_topk_prob) == (123456.0, hf_models.EXPERTS, True)


def test_head_dim_null_means_hidden_over_heads(ckpts, tmp_path):
    d = _copy(ckpts["mixtral"], tmp_path / "m")
    _edit_config(d, head_dim=None)
    assert _model_config(d).head_dim == hf_models.HIDDEN // hf_models.HEADS


def test_norm_topk_prob_default_is_transformers(ckpts, tmp_path):
    d = _copy(ckpts["qwen3_moe"], tmp_path / "q")
    _edit_config(d, norm_topk_prob=_DELETE)
    assert _model_config(d).norm_topk_prob is False


@pytest.mark.parametrize("arch,changes,context", [
    ("mixtral", dict(sliding_window=64), 64),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=128, layer_types=_DELETE), 128),
    ("qwen2_moe", dict(use_sliding_window=False, sliding_window=128, layer_types=_DELETE), hf_models.MAX_POSITIONS),
])
def test_sliding_window_caps_the_context(ckpts, tmp_path, arch, changes, context):
    d = _copy(ckpts[arch], tmp_path / "c")
    _edit_config(d, **changes)
    assert _model_config(d).max_context == context


def test_qwen2_moe_without_qkv_bias_key_reads_the_tensors(ckpts, tmp_path):
    d = _copy(ckpts["qwen2_moe"], tmp_path / "q")
    _edit_config(d, qkv_bias=_DELETE)
    cfg = _model_config(d)
    assert cfg.attention_bias and cfg.shared_expert_gated and cfg.shared_ffn_size == 96


# ---------------------------------------------------------------- expert layouts


def _fuse_experts(src: Path, dst: Path, moe_from: str, moe_to: str, projections: tuple[str, str, str]) -> None:
    """Rewrite a checkpoint with transformers 5's in-memory expert layout: per layer
    `{moe}.experts.gate_up_proj` [E, 2F, D] and `{moe}.experts.down_proj` [E, D, F]."""
    from safetensors.numpy import save_file

    dst.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors = {}
    with Checkpoint(src) as ckpt:
        for name in ckpt.tensors:
            if ".experts." not in name:
                tensors[name.replace(f".{moe_from}.", f".{moe_to}.")] = ckpt.read(name)
        for l in range(hf_models.LAYERS):
            base = f"model.layers.{l}.{moe_from}.experts."
            g, u, dn = ([ckpt.read(f"{base}{e}.{p}.weight") for e in range(hf_models.EXPERTS)] for p in projections)
            out = f"model.layers.{l}.{moe_to}.experts."
            tensors[out + "gate_up_proj"] = np.stack([np.concatenate([a, b]) for a, b in zip(g, u)])
            tensors[out + "down_proj"] = np.stack(dn)
    save_file(tensors, str(dst / "model.safetensors"))


@pytest.mark.parametrize("arch,moe_from,moe_to,projections", [
    ("qwen3_moe", "mlp", "mlp", ("gate_proj", "up_proj", "down_proj")),
    ("mixtral", "block_sparse_moe", "mlp", ("w1", "w3", "w2")),
])
def test_fused_expert_layout_converts_identically(ckpts, tmp_path, arch, moe_from, moe_to, projections):
    fused = tmp_path / "fused"
    _fuse_experts(ckpts[arch], fused, moe_from, moe_to, projections)
    a = convert(ckpts[arch], tmp_path / "classic", expert_type=QuantType.Q8_0)
    b = convert(fused, tmp_path / "fusedout", expert_type=QuantType.Q8_0)
    assert a.cfg == b.cfg
    with ExpertsFile.open(a.experts_path) as xa, ExpertsFile.open(b.experts_path) as xb:
        for l in range(a.cfg.n_layers):
            for e in range(a.cfg.n_experts):
                assert xa.checksum(l, e) == xb.checksum(l, e)


# ---------------------------------------------------------------- bad input


def test_missing_shard(ckpts, tmp_path, capsys):
    d = _copy(ckpts["mixtral"], tmp_path / "m")
    victim = sorted(d.glob("model-*.safetensors"))[2]
    victim.unlink()
    line = _cli_error(capsys, d, tmp_path / "out" / "model")
    assert "missing shard" in line and victim.name in line


@pytest.mark.parametrize("keep", [0.5, 0.999, 4 / 1e9], ids=["half", "last-bytes", "no-header"])
def test_truncated_safetensors(ckpts, tmp_path, capsys, keep):
    d = _copy(ckpts["qwen3_moe"], tmp_path / "q")
    f = d / "model.safetensors"
    os.truncate(f, max(4, int(f.stat().st_size * keep)))
    line = _cli_error(capsys, d, tmp_path / "out")
    assert "truncated" in line and "model.safetensors" in line


def test_unknown_model_type(ckpts, tmp_path, capsys):
    d = _copy(ckpts["qwen3_moe"], tmp_path / "q")
    _edit_config(d, model_type="llama4_text")
    line = _cli_error(capsys, d, tmp_path / "out")
    assert "llama4_text" in line
    for t in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral"):
        assert t in line


@pytest.mark.parametrize("arch,changes,what", [
    ("qwen3_moe", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "yarn"),
    ("qwen3_moe", dict(rope_parameters=_DELETE, rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen2_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
    ("qwen3_moe", dict(hidden_act="gelu"), "gelu"),
    ("qwen3_moe", dict(quantization_config={"quant_method": "fp8"}), "pre-quantized"),
    ("mixtral", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_unsupported_feature(ckpts, tmp_path, capsys, arch, changes, what):
    d = _copy(ckpts[arch], tmp_path / "c")
    _edit_config(d, **changes)
    line = _cli_error(capsys, d, tmp_path / "out")
    assert what in line and "unsupported" in line and "supported:" in line


def test_olmoe_clip_qkv_is_refused(tmp_path_factory, tmp_path, capsys):
    d = _copy(hf_models.cached_checkpoint("olmoe", tmp_path_factory)[0], tmp_path / "o")
    _edit_config(d, clip_qkv=8.0)
    assert "clip_qkv" in _cli_error(capsys, d, tmp_path / "out")


def test_tensor_without_a_place_is_refused(ckpts, tmp_path, capsys):
    """An o_proj bias (Qwen3 with attention_bias) is a feature strata does not compute."""
    from safetensors.numpy import save_file

    d = tmp_path / "q"
    d.mkdir()
    for f in ckpts["qwen3_moe"].iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, d / f.name)
    with Checkpoint(ckpts["qwen3_moe"]) as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.tensors}
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(hf_models.HIDDEN, np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    line = _cli_error(capsys, d, tmp_path / "out")
    assert "o_proj.bias" in line and "supported:" in line


def test_expert_ffn_must_fit_quant_blocks(tmp_path, capsys):
    d = tmp_path / "odd"
    hf_models.write_synthetic_checkpoint(d, layers=1, experts=4, hidden=64, ffn=48, shards=1)
    line = _cli_error(capsys, d, tmp_path / "out", "--experts", "q2_0")
    assert "48" in line and "multiple of 32" in line
    assert main(["convert", str(d), str(tmp_path / "ok"), "--experts", "f16", "--quiet"]) == 0


@pytest.mark.parametrize("remove", ["config.json", "tokenizer.json"])
def test_missing_files(ckpts, tmp_path, capsys, remove):
    d = _copy(ckpts["qwen3_moe"], tmp_path / "q")
    (d / remove).unlink()
    assert remove in _cli_error(capsys, d, tmp_path / "out")


def test_not_a_directory(tmp_path, capsys):
    assert "not a directory" in _cli_error(capsys, tmp_path / "nope", tmp_path / "out")


def test_unknown_expert_type(ckpts, tmp_path, capsys):
    assert "q3_k" in _cli_error(capsys, ckpts["qwen3_moe"], tmp_path / "out", "--experts", "q3_k")



def test_rope_parameters_with_full_rotary_factor_is_plain_rope(ckpts, tmp_path):
    d = _copy(ckpts["qwen3_moe"], tmp_path / "q")
    _edit_config(d, rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 1.0})
    assert _model_config(d).rope_theta == 5e5


# ---------------------------------------------------------------- tokenizer files


def test_chat_template_sources_in_transformers_order(ckpts, tmp_path):
    from strata.convert.tokenizer_files import read_tokenizer_files

    d = _copy(ckpts["qwen3_moe"], tmp_path / "q")
    cfg_path = d / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text())
    tc["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    tc["bos_token"] = {"content": "<|endoftext|>", "special": True}
    cfg_path.write_text(json.dumps(tc))
    got = read_tokenizer_files(d)
    assert got.chat_template == "D"
    assert got.special_tokens == {"bos_token": "<|endoftext|>", "eos_token": hf_models.EOS_TOKEN,
                                  "pad_token": "<|endoftext|>"}
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert read_tokenizer_files(d).chat_template == "J"
    (d / "chat_template.jinja").write_text("K")
    assert read_tokenizer_files(d).chat_template == "K"


# ---------------------------------------------------------------- invalid values and weights


@pytest.mark.parametrize("field, value", [("rope_theta", float("nan")), ("rope_theta", 0), ("rope_theta", -1),
                                          ("rms_norm_eps", -1), ("rms_norm_eps", float("nan"))])
def test_invalid_rope_theta_and_eps_are_refused(ckpts, tmp_path, capsys, field, value):
    d = _copy(ckpts["mixtral"], tmp_path / "m")
    if field == "rope_theta":
        _edit_config(d, rope_parameters={"rope_type": "default", "rope_theta": value})
    else:
        _edit_config(d, **{field: value})
    line = _cli_error(capsys, d, tmp_path / "out")
    assert field in line and "finite number > 0" in line


@pytest.mark.parametrize("tensor", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight"])
def test_non_finite_weights_are_refused_naming_the_tensor(ckpts, tmp_path, capsys, tensor):
    from safetensors.numpy import save_file

    d = tmp_path / "q"
    d.mkdir()
    for f in ckpts["qwen3_moe"].iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, d / f.name)
    with Checkpoint(ckpts["qwen3_moe"]) as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.tensors}
    if tensor not in tensors:  # fused expert layouts name their experts differently
        tensor = next(n for n in tensors if ".experts." in n)
    tensors[tensor] = tensors[tensor].copy()
    tensors[tensor].flat[5] = np.inf
    save_file(tensors, str(d / "model.safetensors"))
    line = _cli_error(capsys, d, tmp_path / "out")
    assert "non-finite" in line
    if "experts" in tensor:
        assert "expert" in line and "up" in line
    else:
        assert tensor in line
