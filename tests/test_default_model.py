"""The embedded default model (strata/data/default.gguf + .experts, docs/model-card.md): it loads
through the public loader like any converted checkpoint, it has learned its corpus, and
`strata generate PROMPT` uses it."""

import re

import numpy as np
import pytest

import strata
from strata.cli.main import main
from strata.default_model import EMBEDDED, default_model_path
from strata.formats.quant_types import QuantType
from strata.reference.model import ModelParams, ModelState, forward
from strata.testing.models import make_dense, make_expert

HELDOUT = EMBEDDED.parent / "heldout.txt"
PPL_TOKENS = 256  # the first tokens of heldout.txt: ~2 s through the reference forward
# Measured on those 256 tokens (model card): trained 43.5, untrained 3150 (seed 0); over all of
# heldout.txt 13.6 vs 3350. A factor of 20 leaves the trained model 3.6x of room on this short,
# comment-heavy slice, and fails a model whose conversion, quantization or weights are broken.
PPL_FACTOR = 20
SHIPPED_EXPERT_TYPE = QuantType.Q2_0  # the type the streaming MLX path reads (model card: why)

pytestmark = pytest.mark.skipif(not EMBEDDED.exists(), reason="the embedded model is not in this checkout")


@pytest.fixture(scope="module")
def model():
    return strata.load(EMBEDDED)


@pytest.fixture(scope="module")
def heldout_ids(model):
    return np.asarray(model.tokenizer.encode(HELDOUT.read_text(encoding="utf-8"))[:PPL_TOKENS], np.int64)


def perplexity(params: ModelParams, ids: np.ndarray) -> float:
    """Teacher-forced, from an empty cache. Shapes: ids [T] -> scalar"""
    logits, _ = forward(params, ModelState.empty(params.cfg), ids)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


class _RandomExperts:
    def __init__(self, cfg) -> None:
        self.cfg, self.made = cfg, {}

    def expert(self, layer: int, expert: int):
        if (layer, expert) not in self.made:
            self.made[(layer, expert)] = make_expert(self.cfg, 0, layer, expert, SHIPPED_EXPERT_TYPE)
        return self.made[(layer, expert)]


def test_default_model_is_the_embedded_one_loaded_like_any_other(model):
    assert default_model_path(announce=False) == EMBEDDED
    assert model.model_path == EMBEDDED
    cfg = model.cfg
    assert cfg.architecture == "qwen2_moe"  # written by `strata convert`, not by a special path
    assert (cfg.n_layers, cfg.n_experts, cfg.n_experts_per_token) == (8, 64, 4)
    assert model.experts_file.header.qtype == SHIPPED_EXPERT_TYPE
    assert model.tokenizer.vocab_size <= cfg.vocab_size


def test_heldout_perplexity_far_below_the_untrained_model(model, heldout_ids):
    assert len(heldout_ids) == PPL_TOKENS
    trained = perplexity(model.resident_params(), heldout_ids)
    untrained = perplexity(ModelParams(model.cfg, make_dense(model.cfg, 0), _RandomExperts(model.cfg)), heldout_ids)
    assert untrained > model.cfg.vocab_size / 2  # random weights: about uniform or worse
    assert trained * PPL_FACTOR < untrained, (trained, untrained)


def test_generate_without_a_model_prints_python(capsys):
    code = main(["generate", "def fibonacci(n):", "-n", "24"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "24 generated" in err
    assert "\ufffd" not in out and out.strip()
    assert re.search(r"\n {4}\S", out), out  # the function body is indented, as Python is


def test_the_embedded_model_chats_in_python_comments(model):
    from strata.chat_template import render_chat

    text = render_chat(model.tokenizer.chat_template, [
        {"role": "system", "content": "Answer in Python.\nBe brief."},
        {"role": "user", "content": "add two numbers"},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "now subtract"}])
    assert text == ("# system: Answer in Python.\n# Be brief.\n# user: add two numbers\n"
                    "def add(a, b):\n    return a + b\n\n# user: now subtract\n")
