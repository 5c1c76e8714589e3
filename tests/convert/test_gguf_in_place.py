"""A llama.cpp GGUF run in place (strata/convert/gguf_in_place.py) against the same file converted.

For every family the GGUF converter reads, from the builders that write llama.cpp's layout
(tests/gguf_models.py, gguf_sigmoid_models.py, gguf_gpt_oss.py, gguf_qwen3next.py), with
K-/IQ-/MXFP4/Q8_0/Q4_0 experts, a UD-like mix per layer and projection, a fused gate/up and a split
file: the config and every dense weight equal the converted model's, every record put together in
place is the converted record byte for byte (up to its layer's record_bytes), and the logits and
32 greedy tokens are the converted run's bit for bit, all resident, with every expert in the arena
and at the smallest legal arena. A file changed under a run is caught on the next read of a
record, a NaN block on its first; nothing is written beside the file. (Corrupt files given to a run
in place: tests/convert/test_convert_gguf_corrupt.py.)"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from engine_kinds import EXACT0, min_slots, open_kind
from strata.cli.main import main
from strata.convert import convert
from strata.errors import ExpertReadError, FormatError
from strata.formats.expert_pieces import READ_ALIGN, PieceStore
from strata.loader import load
from tests import gguf_models, hf_models
from tests.gguf_gpt_oss import write_gpt_oss_gguf
from tests.gguf_qwen3next import write_qwen35moe_gguf, write_qwen3next_gguf
from tests.gguf_sigmoid_models import write_deepseek2_gguf, write_glm4moe_gguf, write_minimax_m2_gguf
from tests.convert_parity import greedy_run

GREEDY_TOKENS = 32


def _one_group(hf_dir, out):
    """glm4_moe's fixture with one expert group (the GGUF builder writes none)."""
    shutil.copytree(hf_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(n_group=1, topk_group=1)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# case -> (checkpoint fixture, build(hf_dir, tmp) -> the GGUF path)
CASES = {
    "qwen3moe-Q8_0": ("qwen3_moe", lambda h, t: gguf_models.write_gguf(h, t / "m.gguf", experts="Q8_0", dense="F16")),
    "qwen2moe-Q4_0": ("qwen2_moe", lambda h, t: gguf_models.write_gguf(h, t / "m.gguf", experts="Q4_0", dense="Q8_0")),
    "olmoe-F16": ("olmoe", lambda h, t: gguf_models.write_gguf(h, t / "m.gguf", experts="F16", dense="Q4_0")),
    "llama-Q8_0": ("mixtral", lambda h, t: gguf_models.write_gguf(h, t / "m.gguf", experts="Q8_0", dense="F32")),
    "qwen3moe-MXFP4": ("qwen3_moe", lambda h, t: gguf_models.write_gguf(h, t / "m.gguf", experts="MXFP4")),
    "qwen3moe-fused": ("qwen3_moe", lambda h, t: gguf_models.write_gguf(h, t / "m.gguf", fuse_gate_up=True)),
    "qwen3moe-split": ("qwen3_moe", lambda h, t: gguf_models.write_gguf(h, t / "m.gguf", split_max_tensors=10)),
    "ud-mix": (None, lambda h, t: gguf_models.write_gguf(
        gguf_models.build_wide_checkpoint(t / "hf", layers=len(gguf_models.UD_MIX)), t / "ud.gguf",
        experts=gguf_models.UD_MIX, dense="Q6_K")),
    "deepseek2-Q8_0": ("deepseek_v3", lambda h, t: write_deepseek2_gguf(h, t / "m.gguf", experts="Q8_0", dense="F16")),
    "glm4moe-Q8_0": ("glm4_moe", lambda h, t: write_glm4moe_gguf(_one_group(h, t / "hf"), t / "m.gguf", experts="Q8_0")),
    "minimax-m2-Q8_0": ("minimax_m2", lambda h, t: write_minimax_m2_gguf(h, t / "m.gguf", experts="Q8_0")),
    "gpt-oss-MXFP4": ("gpt_oss_bf16", lambda h, t: write_gpt_oss_gguf(h, t / "m.gguf", experts="MXFP4")),
    "qwen3next-Q8_0": ("qwen3_next", lambda h, t: write_qwen3next_gguf(h, t / "m.gguf", experts="Q8_0")),
    "qwen35moe-Q8_0": ("qwen3_5_moe_text", lambda h, t: write_qwen35moe_gguf(h, t / "m.gguf", experts="Q8_0")),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    fixture, build = CASES[request.param]
    work = tmp_path_factory.mktemp(request.param)
    hf_dir = hf_models.cached_checkpoint(fixture, tmp_path_factory)[0] if fixture else None
    path = build(hf_dir, work)
    converted = load(convert(path, work / "converted").model_path)
    in_place = load(path)
    yield request.param, path, converted, in_place
    converted.close()
    in_place.close()


def test_config_dense_weights_and_records_are_the_conversion_s(pair):
    _, path, converted, in_place = pair
    store, xf = in_place.experts_file, converted.experts_file
    assert isinstance(store, PieceStore) and in_place.model_path == path
    assert in_place.cfg == converted.cfg
    assert sorted(in_place.dense) == sorted(converted.dense)
    for name in converted.dense:
        assert type(in_place.dense.stored(name)) is type(converted.dense.stored(name)), name
        np.testing.assert_array_equal(in_place.dense[name], converted.dense[name], err_msg=name)
    h, want = store.header, xf.header
    assert (h.n_layers, h.n_experts, h.hidden, h.expert_ffn, h.biases, h.layer_qtypes, h.qtype, h.padded_bytes) == (
        want.n_layers, want.n_experts, want.hidden, want.expert_ffn, want.biases, want.layer_qtypes, want.qtype,
        want.padded_bytes)
    slot = np.full(h.padded_bytes, 0xA5, np.uint8)  # stale bytes: the gaps between planes must come back zero
    for layer in range(h.n_layers):
        rec = xf.layer_layout(layer)
        assert store.layer_layout(layer) == rec
        for e in range(h.n_experts):
            got = store.read_record(layer, e, out=slot)
            assert got[:rec.record_bytes].tobytes() == xf.read_record(layer, e)[:rec.record_bytes].tobytes(), (layer, e)
    assert in_place.tokenizer.encode(hf_models.PARITY_TEXT) == converted.tokenizer.encode(hf_models.PARITY_TEXT)


def test_reads_are_whole_pages_around_each_slice(pair):
    _, _, converted, in_place = pair
    store = in_place.experts_file
    n_files = len(store.files)
    for layer in range(store.header.n_layers):
        reads = store.reads(layer, store.header.n_experts - 1)
        assert 1 <= len(reads) <= 3 + 3 * store.header.biases
        for r in reads:
            assert r.start % READ_ALIGN == 0 and r.length % READ_ALIGN == 0 and 0 <= r.file < n_files
            assert all(0 <= at and at + p.nbytes <= r.need <= r.length for p, at in r.pieces)
    assert store.reads_per_record > converted.experts_file.reads_per_record == 1



@pytest.mark.parametrize("kind", ["reference", "numpy-full", "numpy-min"])
def test_logits_and_greedy_tokens_are_the_converted_run_s(pair, kind):
    _, _, converted, in_place = pair
    prompt = list(converted.tokenizer.encode("The quick brown fox"))
    with open_kind(converted, kind, EXACT0) as eng:
        want_tokens, want_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
    with open_kind(in_place, kind, EXACT0) as eng:
        got_tokens, got_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
        if kind != "reference":
            assert eng.io.bytes_read > 0 and eng.io.errors == 0
            assert "aligned reads per record in place" in eng.report().io
    assert got_tokens == want_tokens
    np.testing.assert_array_equal(got_logits, want_logits)


# ---------------------------------------------------------------- corrupt and changed files


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    work = tmp_path_factory.mktemp("in_place_corrupt")
    return gguf_models.write_gguf(hf_dir, work / "m.gguf", experts="Q8_0")


def _copy(path, tmp_path):
    out = tmp_path / path.name
    shutil.copy(path, out)
    return out


def test_an_expert_changed_under_the_run_is_caught_on_its_next_read(qwen3, tmp_path):
    path = _copy(qwen3, tmp_path)
    model = load(path)
    try:
        store = model.experts_file
        store.read_record(1, 3)  # its first read: the CRC-32 kept
        r = store.reads(1, 3)[0]
        p, at = r.pieces[0]
        with open(path, "r+b") as f:  # one code byte of the record flipped on disk
            f.seek(r.start + at + 100)
            b = f.read(1)
            f.seek(r.start + at + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(FormatError, match=r"MoE layer 1 expert 3: checksum mismatch: .* its first read gave"):
            store.read_record(1, 3)
        store.read_record(0, 0)  # another record is read as it was
    finally:
        model.close()


def test_the_reader_pool_catches_experts_changed_under_the_run(qwen3, tmp_path):
    """Streaming at the smallest arena: records read before the file changed are read again, and
    the first such read is refused naming the record (the CRC-32 of its first read kept)."""
    path = _copy(qwen3, tmp_path)
    with load(path) as model:
        store, h = model.experts_file, model.experts_file.header
        with open_kind(model, "numpy-min", EXACT0) as eng:
            logits = eng.prefill(list(model.tokenizer.encode("The quick brown fox")))
            with open(path, "r+b") as f:  # every record's first code byte flipped on disk
                for layer in range(h.n_layers):
                    for e in range(h.n_experts):
                        r = store.reads(layer, e)[0]
                        at = r.start + r.pieces[0][1] + 8
                        f.seek(at)
                        b = f.read(1)
                        f.seek(at)
                        f.write(bytes([b[0] ^ 0xFF]))
            with pytest.raises(ExpertReadError, match=r"MoE layer \d+ expert \d+: checksum mismatch"):
                for _ in range(GREEDY_TOKENS):
                    logits = eng.decode(int(np.argmax(logits)))


def test_a_non_finite_expert_block_is_refused_on_its_first_read(qwen3, tmp_path):
    """A Q8_0 block whose scale is NaN: the conversion refuses it; in place its first read does."""
    path = _copy(qwen3, tmp_path)
    model = load(path)
    try:
        r = model.experts_file.reads(0, 2)[0]
        p, at = r.pieces[0]
        with open(path, "r+b") as f:  # the first block's float16 d
            f.seek(r.start + at)
            f.write(np.float16(np.nan).tobytes())
        with pytest.raises(FormatError, match=r"MoE layer 0 expert 2 (gate|up|down) projection: 32 non-finite"):
            model.experts_file.read_record(0, 2)
    finally:
        model.close()


def test_generate_runs_in_place_and_writes_nothing(qwen3, tmp_path, capsys):
    path = _copy(qwen3, tmp_path)
    with load(path) as model:
        slots = min_slots(model)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["generate", str(path), "Hello", "-n", "4", "--arena", f"{slots}slots"]) == 0
    assert capsys.readouterr().out.strip()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_serve_answers_from_a_gguf_in_place(qwen3):
    """`strata serve model.gguf` loads it as `generate` does: a completion, the same text as the
    library's greedy generation on the same file."""
    from starlette.testclient import TestClient

    from serve_support import make_app
    from strata import generate

    with load(qwen3) as model:
        want = generate(model, "Hello", max_tokens=6).text
        with TestClient(make_app(model)) as client:
            r = client.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 6,
                                                     "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want


def test_a_later_part_of_a_split_gguf_names_the_first(tmp_path, tmp_path_factory, capsys):
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    first = gguf_models.write_gguf(hf_dir, tmp_path / "m.gguf", split_max_tensors=10)
    second = sorted(tmp_path.glob("m-*-of-*.gguf"))[1]
    with pytest.raises(FormatError, match=r"part 2 of a \d+-part split GGUF; give the first part \(" + first.name):
        load(second)
    capsys.readouterr()
    assert main(["generate", str(second), "hi"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
