"""CUDA sources handed to MLX as includes of files named by their content (included_source.py):
MLX's CUDA build hashes a custom kernel's whole source on every evaluation. Here: the files hold
the text byte for byte, a changed text is a new file, what must stay inline stays inline, and on
a GPU a decoded token is the same bits either way."""

from __future__ import annotations

import subprocess
import shutil

import mlx.core as mx
import numpy as np
import pytest

from strata.mlx_backend.kernels import dense_gemv, included_source
from strata.mlx_backend.kernels.launch import KernelPath, gpu_dialect
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.source import KernelSource, mlx_source


@pytest.fixture
def in_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(included_source, "_dir", [tmp_path])
    return tmp_path


def _target(line: str) -> str:
    assert line.startswith('#include "') and line.endswith('"\n'), line
    return line[len('#include "'):-2]


def test_the_included_files_hold_the_header_and_body_byte_for_byte(in_dir):
    header, body = mlx_source(dense_gemv.SOURCE, Dialect.CUDA)
    h, b = included_source.included(header, body, dense_gemv.SOURCE.inputs)
    assert len(h) + len(b) <= 2 * (len(str(in_dir)) + 50) < (len(header) + len(body)) / 4
    for line, text in ((h, header), (b, body)):
        path = _target(line)
        assert path.startswith(str(in_dir))
        with open(path, encoding="utf-8") as f:
            assert f.read() == text


def test_a_changed_body_is_another_file_and_the_same_body_the_same(in_dir):
    body = "  c[0] = x[0] + 1.0f;\n"
    first = included_source.included("", body, ("x",))
    again = included_source.included("", body, ("x",))
    other = included_source.included("", body.replace("1.0f", "2.0f"), ("x",))
    assert first == again and first[1] != other[1]
    assert first[0] == ""  # no header: nothing to include
    assert len(list(in_dir.glob("*.cuh"))) == 2 and not list(in_dir.glob("*.tmp"))


@pytest.mark.parametrize("name", ["x_shape", "x_strides", "x_ndim"])
def test_a_body_that_names_an_input_shape_stays_inline(in_dir, name):
    """MLX passes an input's shape, strides or ndim only when the source string names them."""
    body = f"  c[0] = x[0] * {name}[0];\n"
    assert included_source.included("", body, ("x",)) == ("", body)
    assert not list(in_dir.glob("*.cuh"))


def test_without_a_directory_the_source_stays_inline(in_dir, monkeypatch):
    body = "  c[0] = x[0];\n"
    monkeypatch.setattr(included_source, "_dir", [None])
    assert included_source.included("#define A 1\n", body, ("x",)) == ("#define A 1\n", body)


def test_an_unwritable_directory_is_found_out_once(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(included_source, "default_dir", lambda env=None: blocker / "cuda-src")
    monkeypatch.setattr(included_source, "_dir", [])
    assert included_source.source_dir() is None
    assert included_source.included("", "  c[0] = x[0];\n", ("x",)) == ("", "  c[0] = x[0];\n")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler here")
def test_the_preprocessor_sees_the_same_tokens_either_way(in_dir):
    """What NVRTC compiles: MLX's frame around header and body, included or inline, preprocessed
    (g++ -E -P, the CUDA-only keywords defined away) to the same text."""
    header, body = mlx_source(dense_gemv.SOURCE, Dialect.CUDA)
    h, b = included_source.included(header, body, dense_gemv.SOURCE.inputs)

    def frame(hh: str, bb: str) -> str:
        return hh + "namespace k {\nvoid f() {\n  constexpr int N = 4;\n" + bb + "\n}\n}\n"

    def expanded(text: str) -> str:
        run = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-"], input=text, capture_output=True,
                             text=True, check=True)
        return "\n".join(line.strip() for line in run.stdout.splitlines() if line.strip())

    assert expanded(frame(h, b)) == expanded(frame(header, body))


def test_the_build_gets_the_includes_on_cuda(in_dir, monkeypatch):
    """launch._build hands MLX the included form on CUDA (inline where no directory is writable)."""
    from strata.mlx_backend.kernels import launch as launch_mod

    given = []

    def make(*, name, input_names, output_names, source, header):
        given.append((header, source))
        return lambda **kw: None

    monkeypatch.setattr(launch_mod, "_kernels", {})
    monkeypatch.setattr(launch_mod, "gpu_dialect", lambda: Dialect.CUDA)
    monkeypatch.setattr(mx.fast, "cuda_kernel", make)
    src = KernelSource("strata_included_twin", ("x",), ("c",), "  c[0] = x[0];\n")
    launch_mod._build(src)
    monkeypatch.setattr(included_source, "_dir", [None])
    launch_mod._build(KernelSource("strata_inline_twin", ("x",), ("c",), "  c[0] = x[0];\n"))
    assert _target(given[0][1]).startswith(str(in_dir))
    assert "c[0] = x[0];" in given[1][1]
    assert len(launch_mod._kernels) == 2


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is not Dialect.CUDA, reason="MLX's CUDA build only")
@pytest.mark.parametrize("shared", [False, True], ids=["no-shared-expert", "gated-shared-expert"])
def test_a_decoded_token_is_the_same_bits_included_or_inline_on_the_gpu(monkeypatch, shared):
    from dataclasses import replace

    from strata.mlx_backend.kernels import launch as launch_mod
    from strata.mlx_backend.kernels.launch import using_path
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL, greedy_steps

    cfg = SMALL if shared else replace(SMALL, shared_ffn_size=0, shared_expert_gated=False)
    with using_path(KernelPath.GPU):
        p = random_params(cfg, seed=31, pred_q8=False)
        monkeypatch.setattr(launch_mod, "_kernels", {})  # every kernel built again, inline
        monkeypatch.setattr(included_source, "_dir", [None])
        inline = greedy_steps(p)
        monkeypatch.setattr(launch_mod, "_kernels", {})
        monkeypatch.setattr(included_source, "_dir", [])  # asked again: the cache directory
        included = greedy_steps(p)
    assert included_source.source_dir() is not None
    for a, b in zip(inline, included):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_damaged_file_is_written_again(in_dir):
    body = "  c[0] = x[0] * 3.0f;\n"
    _, b = included_source.included("", body, ("x",))
    path = _target(b)
    with open(path, "w", encoding="utf-8") as f:
        f.write(body.replace("3.0f", "4.0f"))  # same length, other code
    assert included_source.included("", body, ("x",)) == ("", b)
    with open(path, encoding="utf-8") as f:
        assert f.read() == body
