"""`strata doctor model.gguf` on a llama.cpp GGUF: the model runs in place, and the answer says how
its experts are read there against the records `strata convert` writes (reads per expert, the
share needing more than one, bytes read per expert and per token), in text and JSON."""

from __future__ import annotations

import json

from doctor_profile import diagnose_on_profile as _diag
from strata.formats.expert_record import RecordLayout
from strata.formats.expert_pieces import READ_ALIGN
from strata.formats.quant_types import QuantType
from tests import gguf_models, hf_models


def test_a_llama_cpp_gguf_is_answered_in_place_and_converted(tmp_path, tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    path = gguf_models.write_gguf(hf_dir, tmp_path / "m.gguf", experts="Q8_0")
    d = _diag(path)
    c, ip = d.source.counts, d.source.in_place
    assert d.source.kind == "gguf" and c.supported and d.prediction.verdict != "not supported"
    slot = RecordLayout(QuantType.Q8_0, c.hidden, c.expert_ffn).padded_bytes
    # gate, up and down are three tensors: three reads, each of whole pages around its slice
    assert ip["reads_per_record"] == 3.0 and ip["multi_read_share"] == 1.0
    assert ip["converted_bytes_per_record"] == slot
    record = 3 * c.hidden * c.expert_ffn // 32 * 34  # Q8_0: 34 bytes per 32 weights
    assert record <= ip["read_bytes_per_record"] <= record + 3 * 2 * READ_ALIGN
    text = d.text()
    assert f"in place (`strata generate {path}`, nothing converted): 3.0 reads per expert (100% of experts" in text
    assert json.loads(d.to_json())["bytes"]["in_place"] == ip


def test_a_gguf_neither_path_reads_is_not_supported_naming_why(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    w.add_tensor("token_embd.weight", np.zeros((100, 64), np.float32))
    for proj, shape in (("gate", (8, 32, 64)), ("up", (8, 32, 64)), ("down", (8, 64, 32))):
        w.add_tensor(f"blk.0.ffn_{proj}_exps.weight", np.zeros(shape, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    d = _diag(path)
    assert not d.source.counts.supported and not d.source.in_place
    # no context length, no attention: the reading's own one line, as a load or a conversion would say it
    assert "neither a run in place nor `strata convert` reads" in d.source.counts.why_not
    assert "missing metadata key" in d.source.counts.why_not


def test_a_llama_cpp_gguf_s_dense_matrices_are_priced_as_held():
    """A UD-like file written by llama.cpp (dense in K-types): the doctor prices its dense matrices
    in the type most of their weights have, which a load keeps as stored, not as float32."""
    from pathlib import Path

    from strata.doctor.byte_budget import byte_budget
    from strata.doctor.source import read_source
    from strata.formats.gguf_file import open_gguf

    path = Path(__file__).resolve().parents[1] / "fixtures" / "llama_cpp" / "qwen3moe_wide-ud.gguf"
    src = read_source(path)
    reader = open_gguf(path)
    weights: dict[int, int] = {}
    for t in reader.tensors.values():
        if len(t.shape) > 1 and "_exps" not in t.name:
            n = 1
            for d in t.shape:
                n *= d
            weights[int(t.ggml_type)] = weights.get(int(t.ggml_type), 0) + n
    reader.close()
    assert src.dense_qtype is QuantType(max(weights, key=weights.get)) is not QuantType.F32
    dense = next(r for r in byte_budget(src.counts, dense_qtype=src.dense_qtype).rows if r.part == "dense")
    assert dense.qtype == src.dense_qtype.name and dense.resident_bytes < dense.weights  # under a byte a weight
