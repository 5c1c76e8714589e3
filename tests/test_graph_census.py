"""benchmarks/graph_census.py: one decoded token's graph counted with every custom kernel stood
in (no GPU needed): the stood-in nodes are exactly the launches, one more layer adds the layer's
launches (3 chained on CUDA, 5 on Metal), and the GPU dialect is given back afterwards."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import graph_census  # noqa: E402
from strata.mlx_backend.kernels import launch  # noqa: E402
from strata.mlx_backend.kernels.preludes import Dialect  # noqa: E402


@pytest.mark.parametrize("dialect,per_layer", [(Dialect.CUDA, 3), (Dialect.METAL, 5)])
def test_a_layer_adds_its_launches_and_their_outputs(dialect, per_layer):
    before = launch.gpu_dialect()
    one, two = (graph_census.census(replace(graph_census.SMALL, n_layers=n), dialect) for n in (1, 2))
    assert two["launches"] - one["launches"] == per_layer
    assert two["outputs"] - one["outputs"] >= per_layer  # every launch writes at least one output
    assert one["kernels"]["strata_embed"] == {"launches": 1, "inputs": 2, "outputs": 1}  # the table and the token
    assert launch.gpu_dialect() is before  # the stand-in is gone
    # a layer adds its launches and nothing else: its constants (the slot base, eps, absent inputs)
    # are leaves, where a node would be recomputed by the compiled step on every call
    assert two["other_nodes"] == one["other_nodes"]
    assert "Add" not in one["other"]  # device_const's `+ 0`, had it been made inside the graph


def test_a_form_switches_for_its_census_only():
    from strata.mlx_backend import greedy
    cut = graph_census.census(replace(graph_census.SMALL, n_layers=1), Dialect.CUDA, "pick")
    assert cut["kernels"]["strata_chain_greedy_part_greedy_join"]["launches"] == 1
    assert greedy.PICK_KERNEL is False
    plain = graph_census.census(replace(graph_census.SMALL, n_layers=1), Dialect.CUDA)
    assert "strata_chain_greedy_part_greedy_join" not in plain["kernels"]
    assert plain["other_nodes"] > cut["other_nodes"]  # MLX's reductions in place of the pick


def test_the_kernel_constants_are_leaves():
    """device_const, index_view's table and index_const are evaluated when made: a graph that uses
    them holds no node of theirs (mx.compile would recompute one on every call of a step)."""
    import re
    import tempfile

    import mlx.core as mx
    import numpy as np

    fresh = launch.device_const(np.array([0.125, 3.0], np.float32))  # a value no test made before
    launch._index_table.clear()  # the table made again, inside index_const
    seen = fresh[:2] + launch.index_const(12345).astype(mx.float32)[:2]
    with tempfile.TemporaryDirectory() as td:
        dot = Path(td) / "g.dot"
        mx.export_to_dot(str(dot), seen)
        labels = re.findall(r'label\s*=\s*"([^"]*)"', dot.read_text())
    assert sorted(labels) == ["Add", "AsType", "Slice", "Slice"], labels  # this expression's own nodes only
    assert launch.index_const(12345) is launch.index_const(12345)
    assert int(launch.index_const(12345)[0]) == 12345
