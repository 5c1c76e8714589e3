"""The kernel plan (strata/mlx_backend/kernel_plan.py): one frozen value per backend, presets by
name, a plan in force never more than the backend can do, and no module-level kernel switch left
outside it in the MLX backend."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from strata.mlx_backend import kernel_plan
from strata.mlx_backend.kernel_plan import PRESETS, KernelPlan, plan_for, preset, using_plan
from strata.mlx_backend.kernels import attend_split, emulate, phases
from strata.mlx_backend.kernels.launch import KernelPath, using_path
from strata.mlx_backend.kernels.preludes import Dialect

BACKEND = Path(kernel_plan.__file__).parent
# a module-level True / False: the form of every kernel switch the plan replaced
SWITCH = re.compile(r"^[A-Z][A-Z0-9_]* = (True|False)\b", re.MULTILINE)
# the other module-level knobs the benchmarks used to set (now plan fields or deleted)
FORMER_KNOBS = ("EVAL_EVERY", "UNROLL_BUDGET", "GROUPED_MIN_PAIRS", "PROMPT_PATHS", "GEMM", "BUCKET_POSITIONS",
                "USED_ONLY", "FORM")


def test_no_module_level_kernel_switch_is_left_in_the_mlx_backend():
    found = [f"{path.relative_to(BACKEND)}: {m.group(0)}" for path in sorted(BACKEND.rglob("*.py"))
             for m in SWITCH.finditer(path.read_text(encoding="utf-8"))]
    assert not found, "a kernel switch belongs in kernel_plan.KernelPlan:\n" + "\n".join(found)
    knob = re.compile(r"^(" + "|".join(FORMER_KNOBS) + r")\b[^=\n]*=", re.MULTILINE)
    left = [f"{path.relative_to(BACKEND)}: {m.group(0)}" for path in sorted(BACKEND.rglob("*.py"))
            for m in knob.finditer(path.read_text(encoding="utf-8"))]
    assert not left, "\n".join(left)


def test_each_backend_gets_what_it_can_do():
    cuda = plan_for(KernelPath.GPU, Dialect.CUDA)
    metal = plan_for(KernelPath.GPU, Dialect.METAL)
    assert cuda == KernelPlan()  # the measured winners are CUDA's defaults
    assert not metal.chained_launches and not metal.spread_scores  # no chained launches, simd_sum's order
    assert plan_for(KernelPath.EMULATED, None).chained_launches
    assert not plan_for(KernelPath.OPS, None).chained_launches


def test_a_plan_in_force_is_never_more_than_the_backend_can_do():
    with using_path(KernelPath.OPS), using_plan(KernelPlan(chained_launches=True)):
        assert not phases.available()
    with using_path(KernelPath.OPS), using_plan(None):  # None: the plan in force stays
        assert kernel_plan.current() == plan_for(KernelPath.OPS, None)


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the emulator")
def test_a_plan_turns_off_what_the_backend_could_do():
    with using_path(KernelPath.EMULATED):
        assert phases.available() and attend_split.spreads()
        with using_plan(PRESETS["unchained"]):
            assert not phases.available() and attend_split.spreads()
        with using_plan(KernelPlan(spread_scores=False)):
            assert phases.available() and not attend_split.spreads()
        assert phases.available()  # restored after the block


def test_presets_by_name():
    assert preset("default") == KernelPlan()
    assert not preset("host_loop").pipelined and not preset("uncompiled").compiled_decode
    with pytest.raises(ValueError, match="unknown kernel plan 'nope' .*unchained"):
        preset("nope")


def test_a_plan_is_frozen_and_checked():
    plan = KernelPlan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.chained_launches = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="eval_every -1"):
        KernelPlan(eval_every=-1)
