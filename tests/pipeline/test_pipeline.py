"""Pipeline stages (strata.pipeline): the plan, the stage as a layer range of the one loop, and
pipelines of 2 and 3 local processes over mx.distributed's ring backend on 127.0.0.1.

At λ = 0 a stage's arithmetic is the one-process numpy engine's on the same layers, so greedy
tokens, every step's logits and a decode window are compared bit for bit (EXACT), with every
rank at its smallest legal arena. A rank that dies, or a port already in use, must end every
rank with an error that names the cause, within the watchdog's deadline.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import numpy as np
import pytest

import strata
from strata.config import Backend, Config
from strata.default_model import EMBEDDED
from strata.errors import ConfigError
from strata.model_config import LayerRange
from strata.pipeline.plan import plan_stages
from strata.pipeline.stage import open_stage
from strata.reference.model import ModelState, forward
from strata.testing.engines import open_numpy_streaming
from strata.testing.models import SHAPES, make_model
from strata.pipeline.plan import PipelineOptions
from strata.testing.pipeline import ThreadedPipeline, free_ports, run_ops, spawn_ranks
from tests.budgets import PIPELINE_FAULT_DEADLINE_S, PIPELINE_RUN_S

EXACT0 = Config(backend=Backend.NUMPY, moce_lambda=0.0)
PROMPT = list(b"def add(a, b):\n    return")  # 25 positions: one prompt chunk
TOKENS = 5
WINDOW = list(b"xyz")  # after trimming back to the prompt: 3 positions as one (prompt-path) window


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("pipe") / "small", "small", seed=5).model_path


def one_process(path) -> dict:
    """The reference run: one process, the numpy streaming engine, every expert resident."""
    model = strata.load(path)
    slots = model.experts_file.header.n_records
    with open_numpy_streaming(model, EXACT0.replace(arena=f"{slots}slots")) as engine:
        out = run_ops(engine, PROMPT, TOKENS, WINDOW)
    model.close()
    return out


# ---------------------------------------------------------------- the plan


def test_split_by_bytes_balances_and_given_counts_are_kept():
    cfg = SHAPES["demo"]  # 8 equal MoE layers: the embedding tips the first stage's share
    plan = plan_stages(cfg, 2, expert_bytes=16384)
    assert [s.stop - s.start for s in plan.stages] == [4, 4]
    assert plan.stages[0].embeds and plan.stages[-1].heads and not plan.stages[0].heads
    three = plan_stages(cfg, 3, expert_bytes=16384)
    assert max(three.stage_bytes) - min(three.stage_bytes) <= max(three.stage_bytes) // 3
    assert [s.stop - s.start for s in plan_stages(cfg, 2, expert_bytes=16384, stage_layers="3,5").stages] == [3, 5]
    with pytest.raises(ConfigError, match="stage_layers"):
        plan_stages(cfg, 2, expert_bytes=16384, stage_layers="3,4")


def test_a_stage_without_moe_layer_is_refused():
    with pytest.raises(ConfigError, match="no MoE layer"):
        plan_stages(SHAPES["dense-first"], 2, expert_bytes=4096, stage_layers="1,2")


def test_layer_range_names_only_its_tensors():
    cfg = SHAPES["tiny"]  # untied: the head is its own tensor
    first, last = LayerRange(0, 1, 2), LayerRange(1, 2, 2)
    assert "token_embd.weight" in first.dense_names(cfg) and "output.weight" not in first.dense_names(cfg)
    assert not any(n.startswith("blk.0.") for n in last.dense_names(cfg))
    assert {"output.weight", "output_norm.weight"} <= set(last.dense_names(cfg))
    assert last.moe_start(cfg) == 1 and last.moe_layers(cfg) == (1,)


# ---------------------------------------------------------------- stages in one process


def test_reference_forward_over_ranges_composes_to_the_whole(made):
    model = strata.load(made)
    params = model.resident_params()
    tokens = np.array(PROMPT)
    whole, _ = forward(params, ModelState.empty(model.cfg), tokens)
    x = tokens
    for r in (LayerRange(0, 1, 4), LayerRange(1, 3, 4), LayerRange(3, 4, 4)):
        x, _ = forward(params, ModelState.empty(model.cfg), x, layers=r)
    np.testing.assert_array_equal(x, whole)
    model.close()


def test_stages_at_their_smallest_arenas_chain_to_the_one_process_engine(tmp_path):
    """dense-first: stage 0 holds the dense layer and an MoE layer, so the MoE offsets, the dense
    tensors a stage loads and each cache's local layers are all exercised in-process."""
    path = make_model(tmp_path / "df", "dense-first", seed=2).model_path
    want = one_process(path)
    cfg = strata.load(path).cfg
    stages = [LayerRange(0, 2, 3), LayerRange(2, 3, 3)]
    engines = [open_stage(strata.load(path, layers=s), EXACT0, s, arena="min") for s in stages]
    assert [len(e.moe_layers) for e in engines] == [1, 1]
    assert all(e.arena.capacity == e.cache_config.min_capacity for e in engines)
    assert not any(n.startswith("blk.2.") for n in engines[0].model.dense)
    assert cfg.moe_layers == (1, 2)
    x = np.array(PROMPT)
    for e in engines:
        x = e._prefill(x)
    np.testing.assert_array_equal(x, want["logits"][0])
    for e in engines:
        e.close()


def hybrid_ops(engine) -> dict:
    """Prefill, decode, a decode window, then every position's kept_position, and a trim to
    one inside the window (a recurrent layer restores only its snapshots) before decoding on."""
    out = run_ops(engine, PROMPT, TOKENS, WINDOW)
    out["kept"] = np.array([engine.kept_position(n) for n in range(engine.length + 1)])
    back = engine.kept_position(engine.length - 2)  # inside the window: kept per position
    engine.trim(back)
    out["after_trim"] = np.stack([engine.decode(int(t)) for t in b"ok"])
    out["back"] = np.array(back)
    return out


@pytest.mark.parametrize("split", ["2,2", "3,1"])
def test_a_hybrid_model_split_over_stages_equals_one_process(tmp_path, split):
    """The made `hybrid` (three DeltaNet layers, then attention; all MoE) over 2 stages on a
    ring of threads: "2,2" gives each stage recurrent layers, "3,1" leaves the last stage
    attention only. A stage's state holds its own layers only, so its length and kept positions
    are its layers' (an empty recurrent layer of the other stage would pin them to 0); the
    pipeline's kept_position is every stage's, and tokens, logits and kept positions equal the
    one-process engine's bit for bit."""
    path = make_model(tmp_path / "hybrid", "hybrid", seed=3).model_path
    model = strata.load(path)
    with open_numpy_streaming(model, EXACT0.replace(arena=f"{model.experts_file.header.n_records}slots")) as one:
        want = hybrid_ops(one)
    model.close()
    assert 0 < want["back"] < len(PROMPT) + TOKENS + len(WINDOW) - 1
    assert want["kept"][3] == 0  # inside the prompt: the prefill kept only its end
    ring = ThreadedPipeline()
    with ring.open(path, EXACT0, PipelineOptions(stage_layers=split, timeout=60), ["min", "min"]) as engine:
        assert [s.stop - s.start for s in engine.plan.stages] == [int(c) for c in split.split(",")]
        got = hybrid_ops(engine)
    assert ring.join(60) == {1: None}
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.NUMPY])
def test_auto_backend_on_a_gpu_host_says_the_stage_runs_numpy(made, monkeypatch, capsys, backend):
    """Where one host would get MLX (a GPU, Q2_0 experts), `--backend auto` stages run numpy:
    each rank says so in one line at start and in its stage's report; an explicit numpy does not."""
    import strata.engines

    monkeypatch.setattr(strata.engines, "mlx_gpu_available", lambda: True)
    config = EXACT0.replace(backend=backend)
    ring = ThreadedPipeline()
    with ring.open(made, config, PipelineOptions(timeout=60), ["min", "min"]) as engine:
        engine.prefill(PROMPT[:4])
        stages = engine.report().stages
    assert ring.join(60) == {1: None}
    lines = [line for line in capsys.readouterr().err.splitlines() if "runs on numpy although MLX" in line]
    if backend is Backend.AUTO:
        assert sorted(lines) == [f"pipeline rank {r}: backend auto: this stage runs on numpy although MLX has a GPU "
                                 "here (MLX stages are not built yet)" for r in (0, 1)]
        assert all("runs on numpy although MLX" in s.stream["io"] for s in stages)
    else:
        assert lines == [] and not any("although MLX" in s.stream["io"] for s in stages)


def test_ranks_with_different_model_files_all_refuse_and_copies_are_accepted(tmp_path, made):
    """Every rank plans from its own copy: rank 2 holding another model of the same shape is
    refused on every rank (rank 1, which passed the first lap, hears it on the second), in one
    line naming both; byte-identical copies at other paths run."""
    import shutil

    from strata.pipeline.transport import PipelineError

    other = make_model(tmp_path / "other", "small", seed=6).model_path
    ring = ThreadedPipeline()
    with pytest.raises(PipelineError, match="rank 2: its model files are not rank 0's") as refused:
        ring.open(made, EXACT0, PipelineOptions(timeout=60), ["min"] * 3, rank_paths=[made, made, other])
    line = str(refused.value)
    assert "\n" not in line and line.count("model crc32") == 2 and line.count(", experts ") == 2
    assert {r: str(e) for r, e in ring.join(60).items()} == {1: line, 2: line}
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in (made, made.with_suffix(".experts")):
        shutil.copy(p, copy / p.name)
    ring = ThreadedPipeline()
    with ring.open(made, EXACT0, PipelineOptions(timeout=60), ["min"] * 2, rank_paths=[made, copy / made.name]) as e:
        assert e.prefill(PROMPT[:4]).shape == (strata.load(made).cfg.vocab_size,)
    assert ring.join(60) == {1: None}


def test_a_failed_opening_reaches_the_ranks_before_the_one_that_failed(made):
    """The verdict lap: rank 2's own failure (its arena too small) reaches ranks 0 and 1 too."""
    from strata.pipeline.transport import PipelineError

    ring = ThreadedPipeline()
    with pytest.raises(PipelineError, match="pipeline rank 2") as failed:
        ring.open(made, EXACT0, PipelineOptions(timeout=60), ["min", "min", "1slots"])
    assert {r: str(e) for r, e in ring.join(60).items()} == {1: str(failed.value), 2: str(failed.value)}


# ---------------------------------------------------------------- processes over the ring


def run_pipeline(tmp_path, n: int, model, *, die=None, ports=None, deadline=None, stage_layers=""):
    out = tmp_path / "rank0.npz"
    wait = deadline or PIPELINE_RUN_S
    spec = dict(model=str(model), config=dict(backend="numpy", moce_lambda=0.0), arenas=["min"] * n,
                options=dict(timeout=wait, connect_timeout=wait, stage_layers=stage_layers),
                prompt=PROMPT, max_tokens=TOKENS, window=WINDOW, out=str(out), die=die)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    start = time.monotonic()
    ranks = spawn_ranks(n, [sys.executable, "-m", "strata.testing.pipeline", str(tmp_path / "spec.json")],
                        timeout=PIPELINE_RUN_S, ports=ports)
    return ranks, out, time.monotonic() - start


def assert_ran(ranks, out):
    assert all(r.returncode == 0 for r in ranks), "\n".join(f"rank {r.rank}: {r.output}" for r in ranks)
    return dict(np.load(out))


@pytest.mark.parametrize("n, which", [(2, "embedded"), (3, "made")])
def test_pipeline_equals_one_process(tmp_path, made, n, which):
    path = EMBEDDED if which == "embedded" else made
    want = one_process(path)
    ranks, out, _ = run_pipeline(tmp_path, n, path)
    got = assert_ran(ranks, out)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(got["logits"], want["logits"])
    np.testing.assert_array_equal(got["window"], want["window"])
    report = json.loads(str(got["report"]))
    assert [s["rank"] for s in report["stages"]] == list(range(n))
    assert report["stages"][-1]["layers"][1] == strata.load(path).cfg.n_layers
    d = strata.load(path).cfg.hidden_size
    for s in report["stages"][:-1]:  # a middle hop carries one [1, D] float32 row per token, and a header
        assert s["sent_bytes"] == d * 4 + 48
        assert s["stream"]["arena_slots"] > 0 and s["tokens"] == TOKENS


def assert_every_rank_failed(ranks, took, *, says):
    for r in ranks:
        assert r.returncode not in (0, None), f"rank {r.rank} did not fail: {r.output}"
        assert "error: pipeline rank" in r.output, f"rank {r.rank}: {r.output}"
    assert any(says in r.output for r in ranks), "\n".join(r.output for r in ranks)
    assert took < PIPELINE_RUN_S


def test_a_rank_that_dies_ends_every_rank_with_an_error(tmp_path, made):
    ranks, _, took = run_pipeline(tmp_path, 3, made, die=(1, 3), deadline=PIPELINE_FAULT_DEADLINE_S)
    assert ranks[1].returncode == 9  # the one that died
    assert_every_rank_failed([ranks[0], ranks[2]], took, says="rank 1")


def test_a_port_in_use_ends_every_rank_with_an_error(tmp_path, made):
    ports = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[1]))
        taken.listen()
        ranks, _, took = run_pipeline(tmp_path, 2, made, ports=ports, deadline=PIPELINE_FAULT_DEADLINE_S)
    assert_every_rank_failed(ranks, took, says="address is in use")


def test_a_rank_that_never_starts_ends_every_rank_within_the_deadline(tmp_path, made):
    ranks, _, took = run_pipeline(tmp_path, 2, made, die=(1, 0), deadline=PIPELINE_FAULT_DEADLINE_S)
    assert ranks[1].returncode == 9
    assert ranks[0].returncode not in (0, None), ranks[0].output
    assert "did not all connect" in ranks[0].output, ranks[0].output
    assert took < PIPELINE_RUN_S
