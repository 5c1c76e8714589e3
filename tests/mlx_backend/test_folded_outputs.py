"""Outputs no caller reads, folded into one buffer (kernels/folded_outputs.py): the source
declares them as pointers into it and is otherwise the same text; a decoded token's chain and
gate/up launch do fold (fewer outputs; emulated, and on the GPU where there is one), and what a
caller reads never is; the expert step and the attention launch hand h (and z) on in that buffer."""

from __future__ import annotations

import mlx.core as mx
import pytest

from strata.mlx_backend.kernels import folded_outputs, moe_decode, moe_down_warps, paths, phases
from strata.mlx_backend.kernels.folded_outputs import FOLDED, fold_source, folded_launch, offsets
from strata.mlx_backend.kernels.launch import KernelPath, gpu_dialect, using_path
from strata.mlx_backend.kernels.source import KernelSource

SRC = KernelSource("strata_fold_probe", ("x",), ("a", "b", "c"), "  a[0] = x[0];\n  b[0] = 1;\n  c[0] = 2.0f;\n")


def test_the_folded_source_declares_its_outputs_in_the_buffer():
    f = fold_source(SRC, ("a", "b"), ("float32", "int32"))
    assert f.name == SRC.name and f.inputs == SRC.inputs
    assert f.outputs == ("c", FOLDED)
    assert f.body == ("  DEVICE float* const a = (DEVICE float*)(folded + FOLD_a);\n"
                      "  DEVICE int32_t* const b = (DEVICE int32_t*)(folded + FOLD_b);\n" + SRC.body)
    assert fold_source(SRC, ("a", "b"), ("float32", "int32")) is f  # built once


def test_the_packed_source_reads_its_inputs_from_the_buffer():
    src = KernelSource("strata_pack_probe", ("x", "y", "z"), ("c",), "  c[0] = x[0] + y[0] + z[0];\n")
    f = folded_outputs.pack_inputs(src, ("x", "z"), ("float32", "uint32"))
    assert f.name == src.name and f.inputs == ("y", "packed") and f.outputs == ("c",)
    assert f.body == ("  const DEVICE float* const x = (const DEVICE float*)(packed + PACK_x);\n"
                      "  const DEVICE uint32_t* const z = (const DEVICE uint32_t*)(packed + PACK_z);\n" + src.body)


def test_a_packed_build_and_its_unpacked_twin_are_built_apart(monkeypatch):
    """The packed source keeps the kernel's name and outputs: the build cache must tell them apart
    by their inputs, or the second launch runs the first build (on the H200: "Expected `inputs` to
    have size 8 but got size 5")."""
    from strata.mlx_backend.kernels import launch as launch_mod
    from strata.mlx_backend.kernels.preludes import Dialect

    built = []

    def make(*, name, input_names, output_names, source, header):
        def kernel(*, inputs, **kw):
            assert len(inputs) == len(input_names), (input_names, len(inputs))
            return [tuple(input_names)]
        built.append(tuple(input_names))
        return kernel

    monkeypatch.setattr(launch_mod, "_kernels", {})
    monkeypatch.setattr(launch_mod, "gpu_dialect", lambda: Dialect.CUDA)
    monkeypatch.setattr(mx.fast, "cuda_kernel", make)
    src = KernelSource("strata_pack_twin", ("x", "y", "z"), ("c",), "  c[0] = x[0] + y[0] + z[0];\n")
    packed = folded_outputs.pack_inputs(src, ("x", "z"), ("float32", "float32"))
    token = paths._path.set(KernelPath.GPU)  # using_path would ask for a real GPU
    try:
        plain, at = (("N", 1),), (("N", 1), ("PACK_x", 0), ("PACK_z", 256))  # as pack_inputs' callers
        for s, n, template in ((src, 3, plain), (packed, 2, at), (src, 3, plain), (packed, 2, at)):
            got = launch_mod.launch(s, [mx.zeros((64,))] * n, [(1,)], [mx.float32], blocks=(1, 1, 1),
                                    threads=32, template=template)
            assert got == [s.inputs]
    finally:
        paths._path.reset(token)
    assert built == [("x", "y", "z"), ("y", "packed")]  # each built once


@pytest.mark.parametrize("names,dtypes,match", [(("d",), ("float32",), "cannot put"),
                                                (("a", "a"), ("float32", "float32"), "cannot put"),
                                                (("a",), ("float16",), "dtypes"),
                                                ])
def test_what_cannot_be_folded_is_refused(names, dtypes, match):
    with pytest.raises(ValueError, match=match):
        fold_source(SRC, names, dtypes)
    with pytest.raises(ValueError, match="already named"):
        fold_source(KernelSource("strata_fold_clash", ("x",), ("a", FOLDED), "  a[0] = 0.0f;\n"), ("a",), ("float32",))


def test_regions_are_aligned_and_apart():
    at, size = offsets(("a", "b", "c"), ((3,), (1, 5), (4,)), ("float32", "int32", "uint32"))
    assert at == [("FOLD_a", 0), ("FOLD_b", 16), ("FOLD_c", 48)]
    assert size == 64


def test_one_unread_output_is_not_folded():
    seen = []

    def record(src, inputs, shapes, dtypes, *, blocks, threads, template):
        seen.append((src.outputs, tuple(shapes), tuple(template)))
        return [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]

    args = (SRC, [mx.zeros((8,))], [(1,), (1,), (1,)], [mx.float32, mx.int32, mx.float32])
    outs = folded_launch(record, *args, blocks=(1, 1, 1), threads=32, template=(), fold=(1,))
    assert seen[-1][0] == SRC.outputs and len(outs) == 3 and outs[1] is not None
    outs = folded_launch(record, *args, blocks=(1, 1, 1), threads=32, template=(("N", 1),), fold=(0, 1))
    assert seen[-1] == (("c", FOLDED), ((1,), (32,)), (("N", 1), ("FOLD_a", 0), ("FOLD_b", 16)))
    assert outs[0] is None and outs[1] is None and outs[2] is not None


def _launched(path, monkeypatch, shared: bool, launcher, side: str, name: str | None = None) -> list:
    """test_mlx_compiled.greedy_steps on the made shape (with a gated shared expert or none) ->
    the `side` ("inputs" / "outputs") of every source `launcher`'s module launched (named `name`,
    where given). The steps' bits are held to the reference by tests/mlx_backend/test_mlx_compiled.py."""
    from dataclasses import replace

    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL, greedy_steps

    cfg = SMALL if shared else replace(SMALL, shared_ffn_size=0, shared_expert_gated=False)
    seen = []
    real = launcher.launch

    def record(src, *a, **kw):
        if name is None or src.name == name:
            seen.append(getattr(src, side))
        return real(src, *a, **kw)

    with using_path(path):
        p = random_params(cfg, seed=29, pred_q8=False)
        monkeypatch.setattr(launcher, "launch", record)
        greedy_steps(p)
        monkeypatch.setattr(launcher, "launch", real)
    return seen


def _folds_what_no_caller_reads(path, monkeypatch, shared: bool):
    seen = _launched(path, monkeypatch, shared, phases, "outputs")
    # the attention chain keeps what its caller reads as arrays: the router's x_mid (h and z are
    # handed to the gate/up launch in the folded buffer: attend_project.routed_chain)
    assert any(o == ("c_x_mid", FOLDED) for o in seen), seen
    # the gate/up launch of the expert step: every output in the buffer (the down step reads them there)
    assert (FOLDED,) in seen, seen


@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_a_decoded_token_folds_what_no_caller_reads_emulated(monkeypatch, shared):
    _folds_what_no_caller_reads(KernelPath.EMULATED, monkeypatch, shared)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_a_decoded_token_folds_what_no_caller_reads_on_the_gpu(monkeypatch, shared):
    _folds_what_no_caller_reads(KernelPath.GPU, monkeypatch, shared)


def _packed(path, monkeypatch, shared: bool):
    """gate/up's outputs all in its folded buffer, the down step in warps reading hpre, hws, sel,
    wsel (and the shared expert's partials and gate) from it."""
    seen = _launched(path, monkeypatch, shared, phases, "inputs", moe_down_warps.SOURCE.name)
    read = ("hpre", "hws", "sel", "wsel") + (("sout", "sgate") if shared else ())
    assert seen and all(i[-1] == "packed" and not set(read) & set(i) for i in seen)


@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_the_expert_step_hands_h_on_in_one_buffer(monkeypatch, shared):
    _packed(KernelPath.EMULATED, monkeypatch, shared)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_the_expert_step_hands_h_on_in_one_buffer_on_the_gpu(monkeypatch, shared):
    _packed(KernelPath.GPU, monkeypatch, shared)


def test_regions_of_two_buffers_are_refused():
    a, b = (folded_outputs.Region((4,), mx.float32, buffer=mx.zeros((64,), mx.uint8), offset=0) for _ in range(2))
    src = KernelSource("strata_two_regions", ("x", "y"), ("c",), "  c[0] = x[0] + y[0];\n")
    with pytest.raises(ValueError, match="2 buffers"):
        folded_launch(lambda *x, **k: None, src, [a, b], [(1,)], [mx.float32], blocks=(1, 1, 1), threads=32,
                      template=())


def _handed_on(path, monkeypatch, shared: bool):
    """The attention launch's h and z read by gate/up from its folded buffer."""
    on = _launched(path, monkeypatch, shared, phases, "inputs", moe_decode.GATEUP_SOURCE.name)
    # every decoded token's gate/up reads them packed (a prompt's router may run apart: arrays)
    handed = [i for i in on if i[-1] == "packed"]
    assert handed and len(handed) >= len(on) // 2 and all("x" not in i and "z" not in i for i in handed)


@pytest.mark.parametrize("path", [KernelPath.EMULATED,
                                  pytest.param(KernelPath.GPU, marks=[pytest.mark.gpu, pytest.mark.skipif(
                                      gpu_dialect() is None, reason="no MLX GPU here")])], ids=["emulated", "gpu"])
@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_the_attention_launch_hands_h_and_z_on(monkeypatch, path, shared):
    _handed_on(path, monkeypatch, shared)
