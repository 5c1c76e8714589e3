"""`strata convert` streams: bounded memory on a larger checkpoint, and an interrupted
conversion leaves nothing under the output's final names.

The checkpoint is hf_models.write_synthetic_checkpoint: a Qwen3-MoE in two BF16 shards whose
routed experts are 384 MiB in float32 (what a convert that loaded every expert would hold),
with a SYNTHETIC_VOCAB embedding and head so the dense weights (68 MiB in float32) are large
enough to see. The memory bound checked (docs/convert.md):

    peak - start <= dense weights in their stored type + 1.5 x the largest dense tensor in
                    float32 (it and its BF16 bytes while it is converted)
                    + 4 x one expert in float32 (its projections and their quantized copies)
                    + RSS_SLACK
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import hf_models
from tests.convert_memory import convert_rss

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
RSS_SLACK = 32 * MIB  # allocator arenas, lazily imported modules, the GGUF writer's buffers
SYNTHETIC_VOCAB = 32768
KILL_AFTER_BYTES = 4 * MIB  # interrupt once this much of the experts file has been written
KILL_WAIT_S = 60.0

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    d = tmp_path_factory.mktemp("synthetic_qwen3")
    experts_f32 = hf_models.write_synthetic_checkpoint(d, vocab=SYNTHETIC_VOCAB)
    return d, experts_f32


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("dense,experts", [("f32", "q2_0"), ("f16", "f16")])
def test_peak_memory_is_dense_plus_one_expert(synthetic, tmp_path, dense, experts):
    directory, experts_f32 = synthetic
    from strata.convert.hf_config import HFConfig
    from strata.convert.qwen_moe import qwen3_moe_config
    from strata.convert.safetensors_reader import Checkpoint
    from strata.model_config import dense_tensor_shapes

    with Checkpoint(directory) as ckpt:
        cfg = qwen3_moe_config(HFConfig.read(directory), ckpt)
    sizes = [math.prod(s) for s in dense_tensor_shapes(cfg).values()]
    stored = {"f32": 4, "f16": 2}[dense]
    dense_stored = sum(n * (stored if len(s) == 2 else 4) for n, s in zip(sizes, dense_tensor_shapes(cfg).values()))
    largest_f32 = 4 * max(sizes)
    expert_f32 = 3 * 4 * cfg.hidden_size * cfg.expert_ffn_size
    bound = dense_stored + 1.5 * largest_f32 + 4 * expert_f32 + RSS_SLACK
    start, peak = convert_rss(str(directory), str(tmp_path / "out"), "--experts", experts, "--dense", dense)
    print(f"\n--dense {dense} --experts {experts}: peak RSS {peak / MIB:.1f} MiB = {start / MIB:.1f} MiB at start + "
          f"{(peak - start) / MIB:.1f} MiB; dense {dense_stored / MIB:.1f} MiB stored, largest tensor "
          f"{largest_f32 / MIB:.1f} MiB f32, one expert {expert_f32 / MIB:.2f} MiB f32, all experts "
          f"{experts_f32 / MIB:.0f} MiB f32; bound {bound / MIB:.1f} MiB")
    assert peak - start <= bound
    assert peak - start - dense_stored < experts_f32 / 8  # streaming: nowhere near every expert at once
    assert (tmp_path / "out.gguf").exists() and (tmp_path / "out.experts").exists()


def _start_convert(directory: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "strata.cli.main", "convert", str(directory), str(out), "--experts", "q8_0", "--quiet"]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_partial(proc: subprocess.Popen, out: Path) -> None:
    """Until the experts file is being written (KILL_AFTER_BYTES of it exist)."""
    tmp = Path(str(out) + ".experts.partial.tmp")
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"convert finished before it could be interrupted: {proc.communicate()}"
        if tmp.exists() and tmp.stat().st_size >= KILL_AFTER_BYTES:
            return
        time.sleep(0.005)
    proc.kill()
    pytest.fail("convert did not start writing in time")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_interrupted_conversion_leaves_no_output(sig, synthetic, tmp_path):
    out = tmp_path / "out"
    proc = _start_convert(synthetic[0], out)
    _wait_for_partial(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=KILL_WAIT_S)
    assert proc.returncode != 0
    assert not (tmp_path / "out.gguf").exists()
    assert not (tmp_path / "out.experts").exists()
    if sig is not signal.SIGKILL:  # a catchable signal also removes the temporary files
        assert sorted(p.name for p in tmp_path.iterdir()) == []
        assert err.strip().splitlines()[-1] == "interrupted"
