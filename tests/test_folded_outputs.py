"""Outputs no caller reads, folded into one buffer (kernels/folded_outputs.py): the source
declares them as pointers into it and is otherwise the same text; a decoded token writes the
same bits folded or not (emulated, and on the GPU where there is one); the chain and the
gate/up launch do fold (fewer outputs), and what a caller reads never is. The expert step
handing h on in that buffer (moe_decode.PACK_EXPERT_STEP, on) is the same bits too."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from strata.mlx_backend.kernels import folded_outputs, moe_decode, moe_down_warps, phases
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
    monkeypatch.setattr(launch_mod, "GRAPH_VIEWS", False)
    monkeypatch.setattr(mx.fast, "cuda_kernel", make)
    src = KernelSource("strata_pack_twin", ("x", "y", "z"), ("c",), "  c[0] = x[0] + y[0] + z[0];\n")
    packed = folded_outputs.pack_inputs(src, ("x", "z"), ("float32", "float32"))
    token = launch_mod._path.set(KernelPath.GPU)  # using_path would ask for a real GPU
    try:
        plain, at = (("N", 1),), (("N", 1), ("PACK_x", 0), ("PACK_z", 256))  # as pack_inputs' callers
        for s, n, template in ((src, 3, plain), (packed, 2, at), (src, 3, plain), (packed, 2, at)):
            got = launch_mod.launch(s, [mx.zeros((64,))] * n, [(1,)], [mx.float32], blocks=(1, 1, 1),
                                    threads=32, template=template)
            assert got == [s.inputs]
    finally:
        launch_mod._path.reset(token)
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


def _decoded(p, monkeypatch, switch: tuple, launcher, side: str, name: str | None = None):
    """test_mlx_compiled.greedy_steps with `switch` (module, name, value) set -> (its arrays, the
    `side` ("inputs" / "outputs") of every source `launcher`'s module launched (named `name`, where
    given))."""
    from test_mlx_compiled import greedy_steps

    monkeypatch.setattr(*switch)
    seen = []
    real = launcher.launch

    def record(src, *a, **kw):
        if name is None or src.name == name:
            seen.append(getattr(src, side))
        return real(src, *a, **kw)

    monkeypatch.setattr(launcher, "launch", record)
    out = greedy_steps(p)
    monkeypatch.setattr(launcher, "launch", real)
    return out, seen


def _same_bits_either_way(path, monkeypatch, shared: bool, flag: tuple, launcher, side: str,
                          name: str | None = None) -> tuple[list, list]:
    """A decoded token with `flag` (module, name) off and on, the same bits either way -> what
    `launcher`'s module launched, off and on (`_decoded`)."""
    from dataclasses import replace

    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL

    cfg = SMALL if shared else replace(SMALL, shared_ffn_size=0, shared_expert_gated=False)
    with using_path(path):
        p = random_params(cfg, seed=29, pred_q8=False)
        off, off_seen = _decoded(p, monkeypatch, (*flag, False), launcher, side, name)
        on, on_seen = _decoded(p, monkeypatch, (*flag, True), launcher, side, name)
    for a, b in zip(off, on):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return off_seen, on_seen


def _same_bits_folded_or_not(path, monkeypatch, shared: bool):
    # the unread outputs of the expert step as two launches with their own arrays (packed, the
    # default, every gate/up output is in the buffer: _packed_same_bits)
    monkeypatch.setattr(moe_decode, "PACK_EXPERT_STEP", False)
    plain_seen, folded_seen = _same_bits_either_way(path, monkeypatch, shared, (folded_outputs, "FOLD_OUTPUTS"),
                                                    phases, "outputs")
    assert not any(FOLDED in o for o in plain_seen)
    gateup = {o for o in folded_seen if "sel" in o and "wsel" in o}
    # without a shared expert hid and its partials and gate are folded; with one, the down step
    # reads those two, and hid alone is not worth folding
    assert gateup == ({moe_decode.GATEUP_SOURCE.outputs} if shared else {("sel", "wsel", "hpre", "hws", FOLDED)})
    return folded_seen


@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_a_decoded_token_is_the_same_bits_folded_or_not_emulated(monkeypatch, shared):
    seen = _same_bits_folded_or_not(KernelPath.EMULATED, monkeypatch, shared)
    # the attention chain keeps what its caller reads as arrays: the router's x_mid (h and z are
    # handed to the gate/up launch in the folded buffer: moe_decode.HAND_ON)
    assert any(o == ("c_x_mid", FOLDED) for o in seen), seen


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_a_decoded_token_is_the_same_bits_folded_or_not_on_the_gpu(monkeypatch, shared):
    _same_bits_folded_or_not(KernelPath.GPU, monkeypatch, shared)


def _packed_same_bits(path, monkeypatch, shared: bool):
    """moe_decode.PACK_EXPERT_STEP: gate/up's outputs all in its folded buffer, the down step in
    warps reading hpre, hws, sel, wsel (and the shared expert's partials and gate) from it."""
    plain_seen, packed_seen = _same_bits_either_way(path, monkeypatch, shared, (moe_decode, "PACK_EXPERT_STEP"),
                                                    phases, "inputs", moe_down_warps.SOURCE.name)
    assert plain_seen and all("hpre" in i and "packed" not in i for i in plain_seen)
    read = ("hpre", "hws", "sel", "wsel") + (("sout", "sgate") if shared else ())
    assert packed_seen and all(i[-1] == "packed" and not set(read) & set(i) for i in packed_seen)


@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_the_expert_step_handing_h_on_in_one_buffer_is_the_same_bits(monkeypatch, shared):
    _packed_same_bits(KernelPath.EMULATED, monkeypatch, shared)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_the_expert_step_handing_h_on_in_one_buffer_is_the_same_bits_on_the_gpu(monkeypatch, shared):
    _packed_same_bits(KernelPath.GPU, monkeypatch, shared)


def test_regions_of_two_buffers_are_refused():
    a, b = (folded_outputs.Region((4,), mx.float32, buffer=mx.zeros((64,), mx.uint8), offset=0) for _ in range(2))
    src = KernelSource("strata_two_regions", ("x", "y"), ("c",), "  c[0] = x[0] + y[0];\n")
    with pytest.raises(ValueError, match="2 buffers"):
        folded_launch(lambda *x, **k: None, src, [a, b], [(1,)], [mx.float32], blocks=(1, 1, 1), threads=32,
                      template=())


def _handed_on_same_bits(path, monkeypatch, shared: bool):
    """moe_decode.HAND_ON: the attention launch's h and z read by gate/up from its folded buffer."""
    off, on = _same_bits_either_way(path, monkeypatch, shared, (moe_decode, "HAND_ON"), phases, "inputs",
                                    moe_decode.GATEUP_SOURCE.name)
    assert off and all("x" in i and "z" in i and "packed" not in i for i in off)
    # every decoded token's gate/up reads them packed (a prompt's router may run apart: arrays)
    handed = [i for i in on if i[-1] == "packed"]
    assert len(handed) >= len(on) // 2 and all("x" not in i and "z" not in i for i in handed)


@pytest.mark.parametrize("path", [KernelPath.EMULATED,
                                  pytest.param(KernelPath.GPU, marks=[pytest.mark.gpu, pytest.mark.skipif(
                                      gpu_dialect() is None, reason="no MLX GPU here")])], ids=["emulated", "gpu"])
@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_the_attention_launch_handing_h_and_z_on_is_the_same_bits(monkeypatch, path, shared):
    _handed_on_same_bits(path, monkeypatch, shared)


@pytest.mark.parametrize("form", ["DEFER_DOWN", "CHAIN_EXPERTS"])
def test_the_forms_that_take_h_and_z_as_arrays_read_the_handed_on_bytes(monkeypatch, form):
    """The deferred and the chained expert steps read h and z as arrays (folded_outputs.region_array
    of the handed-on regions): the same bits as with them never handed on."""
    monkeypatch.setattr(moe_decode, form, True)
    _same_bits_either_way(KernelPath.EMULATED, monkeypatch, False, (moe_decode, "HAND_ON"), phases, "inputs")


def test_a_region_read_as_an_array_is_its_bytes():
    buf = mx.array(np.arange(64, dtype=np.uint8))
    r = folded_outputs.Region((2, 3), mx.float16, buffer=buf, offset=16)
    want = np.arange(16, 28, dtype=np.uint8).view(np.float16).reshape(2, 3)
    assert np.array_equal(np.array(folded_outputs.region_array(r)).view(np.uint16), want.view(np.uint16))
