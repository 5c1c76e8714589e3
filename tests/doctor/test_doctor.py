"""`strata doctor`: verdicts on made models and published configs, with a fixed machine profile
(no probing in tests), the trace path, the CLI and its JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from doctor_configs import PUBLISHED, QWEN3_30B_A3B
from doctor_profile import GB, PROFILE
from doctor_profile import diagnose_on_profile as _diag
from doctor_profile import memory_with as _mem
from strata.config import Config
from strata.doctor import diagnose
from strata.doctor.probe import OpCost, machine_profile
from strata.runtime.memory import MemoryInfo
from strata.testing.models import make_model


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("doctor") / "small", "small")


def made_slot(made) -> int:
    from strata.formats.experts_file import ExpertsFile

    with ExpertsFile.open(made.experts_path) as xf:
        return xf.header.padded_bytes


def test_made_model_fits_resident(made):
    d = _diag(made.model_path)
    p = d.prediction
    assert p.verdict == "fits resident" and not p.streaming and p.tok_per_s > 0
    assert d.source.kind == "strata" and d.budget.slot_bytes == made_slot(made)
    assert p.peak_memory == PROFILE.base_rss + d.budget.dense_resident + d.budget.experts_resident + d.budget.kv_bytes
    assert "verdict: fits resident" in d.text()


def test_made_model_streams_when_memory_is_short(made):
    b = _diag(made.model_path).budget
    # room for the base process, the dense weights, keep and 60 slots (the model's own page cache
    # is the arena's to take: strata.runtime.budget)
    available = PROFILE.base_rss + b.dense_resident + 60 * b.slot_bytes
    d = _diag(made.model_path, available, config=Config(backend="numpy", keep="0"))
    p = d.prediction
    assert p.verdict == "streams" and p.arena_slots == 60 and p.locality is not None
    assert 0 < p.locality.hit_rate < 1 and "calibrated curve" in p.locality.source
    assert p.breakdown["urgent_waits"] > 0 and p.tok_per_s < _diag(made.model_path).prediction.tok_per_s
    # a streaming run's peak takes the streaming base where the profile measured one; the plan's room does not
    lean = dataclasses.replace(PROFILE, base_rss_streaming=PROFILE.base_rss // 2)
    d2 = diagnose(made.model_path, cache_dir=None, config=Config(backend="numpy", keep="0"), profile=lean,
                  memory=_mem(available))
    assert d2.prediction.arena_slots == 60
    assert d2.prediction.peak_memory == p.peak_memory - PROFILE.base_rss // 2


def test_will_not_run_says_why(made):
    d = _diag(made.model_path, available=GB // 2)  # less than keep (auto: 512 MiB)
    assert d.prediction.verdict == "will not run" and "needs at least" in d.prediction.summary


def test_over_budget_arena_is_refused(made):
    d = _diag(made.model_path, available=9 * GB, config=Config(backend="numpy", arena="1GB", keep="9GB"))
    assert d.prediction.verdict == "will not run" and "force_arena=True" in d.prediction.summary  # Python's words
    forced = _diag(made.model_path, available=9 * GB,
                   config=Config(backend="numpy", arena="100slots", keep="9GB", force_arena=True))
    assert forced.prediction.verdict == "streams" and forced.prediction.arena_slots == 100


def test_own_trace_gives_the_hit_rate(made, tmp_path):
    from strata.loader import load
    from strata.tools.trace import record_trace, save_trace

    model = load(made.model_path)
    trace = save_trace(tmp_path / "t.npz", record_trace(model.resident_params(), list(range(40, 80))))
    d = _diag(made.model_path, config=Config(backend="numpy", arena="40slots"), trace=trace)
    assert d.prediction.locality.source.startswith("trace t.npz")
    assert d.prediction.arena_slots == 40


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs(name, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[name]))
    d = _diag(tmp_path)  # a checkpoint directory
    assert d.budget.per_token > 0 and d.budget.all_resident > 10 * GB
    if name in ("Qwen3-30B-A3B", "Qwen3.5-397B-A17B", "gpt-oss-120b"):  # families this version converts
        assert d.source.counts.supported and d.prediction.verdict in ("streams", "fits resident", "will not run")
    else:  # DeepSeek-V3's published checkpoint is FP8
        assert d.prediction.verdict == "not supported"
        assert "not supported by this version yet" in d.text()
    json.loads(d.to_json())


def test_qwen3_on_a_24gb_machine_streams(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    d = _diag(tmp_path / "config.json", available=14 * GB)
    # dense 1.5B weights as float32 = 6 GB; Q2_0 experts 8.9 GB; keep 512 MiB: the rest is the arena
    assert d.prediction.verdict == "streams" and 0 < d.prediction.arena_slots < d.budget.total_experts
    assert "strata convert" in d.text()


def test_cached_profile_is_read_not_remeasured(tmp_path, monkeypatch):
    import dataclasses

    from strata import threads
    from strata.doctor.probe import _machine_id, products_of, run_kernel_threads, save_profile

    monkeypatch.setattr(threads, "busy_cores_now", lambda *a, **k: 0.0)  # the run's kernel threads: fixed
    prof = dataclasses.replace(PROFILE, machine=_machine_id(), products=products_of("numpy"),
                               kernel_threads=run_kernel_threads("numpy", True))
    save_profile(prof, tmp_path)
    assert machine_profile("numpy", tmp_path) == prof


def test_a_compiled_profile_answers_only_for_its_kernel_thread_count(tmp_path, monkeypatch):
    """The kernels' tables and the engine runs scale with the threads they ran on (2 threads
    ~1.5-2x one's here), so a profile is cached per count and read only for a run on that count;
    the report names it."""
    import dataclasses

    from strata import threads
    from strata.doctor import probe
    from strata.doctor.profile import COMPILED

    if not probe.numpy_ops(True, 1).compiled:
        pytest.skip("no compiled kernels here")
    monkeypatch.setattr(threads, "busy_cores_now", lambda *a, **k: 0.0)
    here = {"machine": probe._machine_id(), "products": COMPILED}
    for n in (1, 2):
        probe.save_profile(dataclasses.replace(PROFILE, **here, layer_s=n * 1e-3, kernel_threads=n), tmp_path)
    assert (tmp_path / "machine-numpy-t1.json").exists() and (tmp_path / "machine-numpy-t2.json").exists()
    assert probe.cached_profile("numpy", tmp_path, threads=1).layer_s == 1e-3
    assert probe.cached_profile("numpy", tmp_path, threads=2).layer_s == 2e-3
    assert probe.cached_profile("numpy", tmp_path, threads=3) is None  # never measured on 3: measure again
    assert probe.run_kernel_threads("numpy", True, 3) == 3 and probe.numpy_ops(True, 3).threads == 3
    assert probe.run_kernel_threads("numpy", False) == 0 and probe.run_kernel_threads("mlx", True) == 0
    assert probe.run_kernel_threads("numpy", True) == threads.kernel_threads(0, busy=0.0)  # auto: the idle cores
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    d = diagnose(tmp_path / "config.json", cache_dir=None, config=Config(backend="numpy"), memory=_mem(20 * GB),
                 profile=dataclasses.replace(PROFILE, **here, kernel_threads=2))
    assert "compiled products on 2 kernel threads" in d.text()


def test_op_cost_table():
    cost = OpCost(((1e3, 1e-5), (1e5, 1e-4), (1e7, 1e-1)))
    assert cost.each(10) == 1e-5 and cost.each(1e5) == pytest.approx(1e-4)
    assert cost.each(2e7) == pytest.approx(2e-1)  # past the table: at the last point's rate
    assert 1e-5 < cost.each(1e4) < 1e-4 and cost.seconds(4, 4e5) == pytest.approx(4e-4)


def test_cli_json(made, tmp_path, capsys):
    import dataclasses

    from strata.cli.main import main
    from strata.doctor.probe import _machine_id

    (tmp_path / "machine-numpy.json").write_text(json.dumps(dataclasses.replace(PROFILE, machine=_machine_id()).to_dict()))
    assert main(["doctor", str(made.model_path), "--json", "--backend", "numpy", "--cache-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "strata" and out["prediction"]["verdict"] in ("fits resident", "streams")


def test_cli_help_has_examples(capsys):
    from strata.cli.main import main

    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    assert "examples:" in capsys.readouterr().out


def test_llama_cpp_gguf_metadata(tmp_path):
    """A llama.cpp GGUF: shapes from its metadata, stored bytes from its tensor index."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny-moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    w.add_tensor("token_embd.weight", np.zeros((100, 64), np.float32))
    for l in range(2):
        w.add_tensor(f"blk.{l}.attn_q.weight", np.zeros((64, 64), np.float32))
        for proj, shape in (("gate", (8, 32, 64)), ("up", (8, 32, 64)), ("down", (8, 64, 32))):
            w.add_tensor(f"blk.{l}.ffn_{proj}_exps.weight", np.zeros(shape, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    d = _diag(path)
    c = d.source.counts
    assert d.source.kind == "gguf" and (c.n_layers, c.moe_layers, c.n_experts, c.top_k) == (2, 2, 8, 2)
    assert c.expert_weights == 3 * 64 * 32 and d.source.stored["experts"] == 2 * 3 * 8 * 64 * 32 * 2
    # a conversion keeps the experts' own type (F16 here): the slot is that record's
    from strata.formats.expert_record import RecordLayout
    from strata.formats.quant_types import QuantType

    assert d.source.expert_qtype is QuantType.F16
    assert d.source.slot_bytes == RecordLayout(QuantType.F16, 64, 32).padded_bytes
    assert d.prediction.verdict == "not supported" and "strata convert" in d.prediction.summary


def test_mlx_checkpoint_config(tmp_path):
    cfg = dict(QWEN3_30B_A3B, quantization={"group_size": 64, "bits": 4})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = _diag(tmp_path)
    assert d.source.kind == "mlx" and d.prediction.verdict == "not supported"
    assert "MLX 4-bit" in d.prediction.summary
    bits = 4 + 2 * 16 / 64
    assert d.source.stored["experts"] == int(d.source.counts.total_experts * d.source.counts.expert_weights * bits / 8)


def test_measure_batch_runs_in_one_process_with_each_runs_own_peak(tmp_path):
    """The bounded validation's runs: several in one child, each with its report and a peak
    reset before it (a streaming run after an all-resident one does not inherit its peak),
    and runs past the time limit come back as None rather than failing the rest."""
    from strata.doctor.measure import measure_batch

    demo = make_model(tmp_path / "demo", "demo")  # 512 experts of 32 kB: 16 MB all-resident
    runs = [(demo.model_path, {"backend": "numpy"}), (demo.model_path, {"backend": "numpy", "arena": "76slots"})]
    resident, streaming = measure_batch(runs, max_tokens=8)
    assert not resident.streaming and streaming.streaming and streaming.report["reads_per_token"] > 0
    assert resident.tokens == streaming.tokens == 8
    if Path("/proc/self/clear_refs").exists():
        experts = made_slot(demo) * (demo.cfg.n_moe_layers * demo.cfg.n_experts - 76)
        assert streaming.peak_rss < resident.peak_rss - experts / 2  # its own peak, not the resident run's
    assert measure_batch(runs, max_tokens=8, timeout=0.01) == [None, None]


def test_the_first_answer_prefers_a_calibrated_profile_then_the_quick_probes(tmp_path, monkeypatch, capsys):
    """No probe runs here: each profile is cached, and measuring fails the test."""
    from strata.cli.main import main
    from strata.doctor import probe
    from strata import threads
    from strata.doctor.probe import QUICK_NOTE, _machine_id, first_answer_profile, products_of, run_kernel_threads

    monkeypatch.setattr(probe, "measure_machine", lambda *a, **k: pytest.fail("measured instead of reading the cache"))
    monkeypatch.setattr(threads, "busy_cores_now", lambda *a, **k: 0.0)  # the run's kernel threads: fixed
    here = {"machine": _machine_id(), "products": products_of("numpy"),
            "kernel_threads": run_kernel_threads("numpy", True)}
    quick = dataclasses.replace(PROFILE, **here, notes=(f"{QUICK_NOTE}: warmed processes",))
    full = dataclasses.replace(PROFILE, **here, layer_s=7e-4)
    probe.save_profile(quick, tmp_path, quick=True)
    assert first_answer_profile("numpy", tmp_path) == quick and quick.quick and not full.quick
    assert main(["doctor", "default", "--backend", "numpy", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(str(Path("strata") / "data" / "default.gguf")) or "default.gguf" in out.splitlines()[0]
    assert "the quick probe's: `strata doctor --calibrate` measures fully" in out
    probe.save_profile(full, tmp_path)  # what --calibrate leaves
    assert first_answer_profile("numpy", tmp_path) == full
    assert main(["doctor", "default", "--backend", "numpy", "--cache-dir", str(tmp_path)]) == 0
    assert "--calibrate" not in capsys.readouterr().out


def test_calibrate_measures_the_full_probe_and_says_how_far_it_got(tmp_path, monkeypatch, capsys):
    from strata.cli.main import main
    from strata.doctor import probe
    from strata.doctor.probe import _machine_id

    asked = []

    def measure(backend, cache_dir, *, progress=None, quick=False, timeout=600, rounds=None, cpu_kernels=True,
                threads=0):
        asked.append((quick, rounds))
        progress("disk")
        return dataclasses.replace(PROFILE, machine=_machine_id())

    monkeypatch.setattr(probe, "measure_machine", measure)
    assert main(["doctor", "default", "--backend", "numpy", "--cache-dir", str(tmp_path), "--calibrate"]) == 0
    err = capsys.readouterr().err
    assert asked == [(False, None)] and (tmp_path / "machine-numpy.json").exists()
    assert "measuring this machine (full probe, several minutes; 0 s): disk" in err
    assert main(["doctor", "default", "--backend", "numpy", "--cache-dir", str(tmp_path / "cold")]) == 0
    assert asked == [(False, None), (True, 1)]  # a cold cache: the quick probe, one round
    assert "measuring this machine (quick probe, about half a minute; 0 s): disk" in capsys.readouterr().err


@pytest.mark.parametrize("share", [1.2, 0.6, 0.3, 0.1, 0.0])
def test_the_printed_plan_is_the_one_open_engine_runs(made, tmp_path, monkeypatch, share):
    """Under memory for `share` of the experts (beside the base process, the dense weights and
    keep; 0.1: less than the default settings' least, 0: less than any legal arena but the
    model file's cached pages), inside a container whose active file pages hold part of the
    model file: the plan `strata doctor` prints (all-resident, or streaming on N slots with the
    read-ahead depth and pins a short arena is fitted with, or refused) is the one `open_engine`
    picks when the engine starts with the memory the doctor predicts for that moment (available
    now, less the base process and the dense weights)."""
    from strata.engines import open_engine
    from strata.errors import ArenaTooSmallError
    from strata.runtime import budget as runtime_budget
    from strata.runtime.decode import StreamingEngine

    b = _diag(made.model_path).budget
    config = Config(backend="numpy")
    keep = runtime_budget.keep_bytes(config.keep, 24 * GB)
    cached = 3 * b.slot_bytes  # the model file's pages the container counts as used: the arena's to take
    monkeypatch.setattr(runtime_budget, "cached_file_bytes", lambda p: cached if Path(p) == made.model_path else 0)
    now = MemoryInfo(total=24 * GB, available=PROFILE.base_rss + b.dense_resident + keep
                     + int(share * b.experts_resident), source="test", active_file=cached)
    d = diagnose(made.model_path, cache_dir=None, config=config, profile=PROFILE, memory=now)
    p = d.prediction
    at_start = dataclasses.replace(now, available=now.available - PROFILE.base_rss - b.dense_resident)
    monkeypatch.setattr(runtime_budget, "machine_memory", lambda: at_start)
    try:
        engine = open_engine(made.model_path, config)
    except ArenaTooSmallError as e:
        assert p.verdict == "will not run" and str(e) in d.text()
        assert share == 0.0
        return
    try:
        streaming = isinstance(engine, StreamingEngine)
        slots = engine.arena.capacity if streaming else 0
        cache = engine.cache_config if streaming else None
        notes = engine.report().io if streaming else ""
    finally:
        engine.close()
    assert (p.streaming, p.arena_slots) == (streaming, slots)
    if streaming:  # the same least, so the same read-ahead depth and pins, and both say so
        assert p.min_slots == cache.min_capacity
        fitted = (cache.prefetch_depth, cache.layer_pins) != (config.prefetch, config.layer_pins)
        assert fitted == ("arena short" in d.text()) == ("arena short" in notes) == (share < 0.2)
    assert p.verdict == ("streams" if streaming else "fits resident") and (share < 1) == streaming
    if streaming:
        assert f"arena {slots} slots" in d.text() and slots > share * b.total_experts  # the model's cache added


def test_compiled_products_price_q8_0_dense_on_their_kernel_and_stay_cached_apart(made, tmp_path, monkeypatch):
    """A profile measured on the compiled kernels prices a Q8_0 dense matrix on its kernel table
    (read as stored, never widened) and Q8_0 experts on their own table; a profile of the other
    products is not read for the run (it is cached apart and re-measured)."""
    from strata.doctor.families import count_strata
    from strata.doctor.byte_budget import byte_budget
    from strata.doctor.predict import ops_seconds, token_bytes
    from strata.doctor.probe import _machine_id, cached_profile, products_of, save_profile
    from strata.doctor.profile import COMPILED, FLOAT32
    from strata.formats.quant_types import QuantType

    counts = count_strata(made.cfg)
    q8 = byte_budget(counts, expert_qtype=QuantType.Q8_0, dense_qtype=QuantType.Q8_0)
    slow = OpCost(((1e3, 1.0), (1e9, 1.0)))  # a second a call: any use of it shows
    widening = dataclasses.replace(PROFILE, widen={"Q8_0": slow})
    kernel = dataclasses.replace(widening, products=COMPILED, kernel_gemv={"Q8_0": OpCost(((1e3, 1e-6), (1e9, 1e-6)))},
                                 expert_kernels={"Q8_0": OpCost(((1e3, 2e-5), (1e9, 2e-5)))})
    assert ops_seconds(counts, q8, widening) > 1.0 > ops_seconds(counts, q8, kernel)
    assert kernel.expert_seconds(q8.record_bytes, "Q8_0") == pytest.approx(
        PROFILE.expert_call_s + 2e-5 - PROFILE.expert.each(PROFILE.calibration_record_bytes))
    f32_dense = sum(q8.widened_per_token.values()) * 32 / 34 * 4  # what widened matmuls read of the same weights
    assert token_bytes(q8, kernel) == pytest.approx(q8.per_token - f32_dense + sum(q8.widened_per_token.values()), rel=1e-3)
    assert token_bytes(q8, widening) == q8.per_token
    from strata import threads
    from strata.doctor.probe import run_kernel_threads

    monkeypatch.setattr(threads, "busy_cores_now", lambda *a, **k: 0.0)  # the run's kernel threads: fixed
    for products in (COMPILED, FLOAT32):
        save_profile(dataclasses.replace(PROFILE, machine=_machine_id(), products=products,
                                         kernel_threads=run_kernel_threads("numpy", products == COMPILED)), tmp_path)
    here = products_of("numpy", cpu_kernels=True)
    assert cached_profile("numpy", tmp_path, cpu_kernels=True).products == here
    assert cached_profile("numpy", tmp_path, cpu_kernels=False).products == FLOAT32
    assert (tmp_path / "machine-numpy-float32.json").exists()


def test_the_probe_times_the_products_a_run_computes_with(monkeypatch):
    """With the compiled kernels (Config.cpu_kernels, where they build) the probe adds the Q8_0
    dense kernel's table and every compiled expert type's own; on numpy's float32 products neither
    (the widened path's tables price every type)."""
    from strata.doctor import probe
    from strata.doctor.profile import COMPILED, FLOAT32

    monkeypatch.setattr(probe, "GEMV_SIZES", (64, 128))
    monkeypatch.setattr(probe, "EXPERT_SIZES", ((64, 32), (128, 64)))
    assert probe.products_of("numpy", cpu_kernels=False) == FLOAT32 and probe.products_of("mlx") == ""
    f32 = probe._compute_numpy(1, probe.numpy_ops(False))
    assert f32["kernel_gemv"] == {} and f32["expert_kernels"] == {} and len(f32["expert"].points) == 2
    ops = probe.numpy_ops(True)
    if not ops.compiled:
        pytest.skip(f"no compiled kernels here: {ops.note}")
    assert probe.products_of("numpy") == COMPILED
    compiled = probe._compute_numpy(1, ops)
    # every compiled type but Q2_0 (the calibration's) whose blocks fit these sizes: not the 256-weight K-quants
    assert set(compiled["kernel_gemv"]) == {"Q8_0"} and set(compiled["expert_kernels"]) == {
        "Q8_0", "Q4_0", "IQ4_NL", "GGML_MXFP4", "Q5_1"}
    assert all(t > 0 for _, t in compiled["kernel_gemv"]["Q8_0"].points)


def test_the_probe_times_q6_k_dense_and_k_quant_experts_at_whole_super_blocks(monkeypatch):
    """A GGUF's Q6_K dense matrices are held as stored and computed on their kernel: the probe
    times that kernel, and the K-quants' experts, where the sizes are whole super-blocks of 256."""
    from strata.doctor import probe

    ops = probe.numpy_ops(True)
    if not ops.compiled:
        pytest.skip(f"no compiled kernels here: {ops.note}")
    monkeypatch.setattr(probe, "GEMV_SIZES", (64, 256, 512))
    monkeypatch.setattr(probe, "EXPERT_SIZES", ((64, 32), (256, 256)))
    compiled = probe._compute_numpy(1, ops)
    assert set(compiled["kernel_gemv"]) == {"Q8_0", "Q6_K"}
    assert len(compiled["kernel_gemv"]["Q8_0"].points) == 3 and len(compiled["kernel_gemv"]["Q6_K"].points) == 2
    assert len(compiled["expert_kernels"]["Q4_K"].points) == 1 and len(compiled["expert_kernels"]["Q8_0"].points) == 2
    assert all(t > 0 for table in compiled["kernel_gemv"].values() for _, t in table.points)


def test_the_doctors_own_process_is_replaced_by_the_runs(made):
    """Memory measured in the doctor's process counts the doctor as used; the run's base process
    takes its place, so only the base beyond the doctor's resident bytes is taken."""
    b = _diag(made.model_path).budget
    now = MemoryInfo(total=24 * GB, available=4 * GB, source="test")
    d = diagnose(made.model_path, cache_dir=None, config=Config(backend="numpy"), profile=PROFILE, memory=now)
    start = d.prediction.memory["available_at_engine_start"]
    assert start == now.available - PROFILE.base_rss - b.dense_resident  # memory given: the run's own
    from strata.doctor.predict import predict

    src_counts = d.source.counts
    own = predict(counts=src_counts, budget=d.budget, profile=PROFILE, config=Config(backend="numpy"), memory=now,
                  supported=True, own_rss=PROFILE.base_rss - (5 << 20))
    assert own.memory["available_at_engine_start"] == now.available - (5 << 20) - b.dense_resident


def test_a_read_costs_at_least_its_bytes_at_the_disks_bandwidth():
    """The fit's per-byte read cost comes from the probe's 4 KiB slots; a fit of 0 s a byte would
    price a megabyte slot's read at its per-read cost alone (faster than the disk delivers it)."""
    from strata.doctor.predict import read_seconds

    slot = 1_671_168  # a Q8_0 expert of 1024 x 512 (three matrices)
    free = dataclasses.replace(PROFILE, read_s=1e-4, read_byte_s=0.0, disk_bytes_per_s=1e9)
    assert read_seconds(free, slot) == pytest.approx(1e-4 + slot / 1e9)
    slow = dataclasses.replace(free, read_byte_s=2e-9)  # a fit above the disk's rate stands
    assert read_seconds(slow, slot) == pytest.approx(1e-4 + 2e-9 * slot)
