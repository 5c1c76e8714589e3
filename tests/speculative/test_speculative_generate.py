"""Speculative windows through `strata.generate` on made models (the issue's acceptance):

- greedy output with speculation on is identical to off, for every drafter (the suffix drafter
  at depths 1..3, a drafter that is always right, one that is always wrong), on every engine:
  full residency (reference, numpy streaming with every slot, MLX resident) and the smallest
  legal arena of each window (numpy and MLX streaming, λ = 0);
- an engine that restores fewer positions than asked (a recurrent layer without per-position
  snapshots) still gives the same output: speculation uses only `kept_position` and `trim`;
- sampled output has the model's distribution: chi-square over the first three tokens' joint
  distribution, computed exactly, for a point-mass drafter and one that samples its own q.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

import strata
from strata.config import Backend, Config
from strata.engines import open_engine
from strata.formats.quant_types import QuantType
from strata.numpy_backend.engine import ReferenceEngine
from strata.reference.sampling import SamplerConfig, probabilities
from strata.speculative import Draft
from strata.testing.models import make_model
from tests.budgets import CHI_SQUARE_P
from engine_kinds import open_kind  # noqa: E402

PROMPT = list(b"x = f(a)\ny = f(b)\nz = f(")
TOKENS = 32
EXACT0 = Config(moce_lambda=0.0, spec_gate=False)  # gate off: every window drafts (timing-free)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("spec") / "tiny", "tiny", seed=3, dense_type=QuantType.F16)
    m = strata.load(made.model_path)
    yield m
    m.close()


class ModelDrafter:
    """Drafts with a second engine of the same model (what an MTP head does with its own layers):
    temperature 0 proposes its argmax chain (a point mass, like the suffix drafter); above 0 it
    samples from its own tempered distribution and says so (`Draft.probs`)."""

    def __init__(self, engine, depth: int, temperature: float = 0.0, seed: int = 0) -> None:
        self.engine, self.depth, self.temperature = engine, depth, temperature
        self.name = f"model-{depth}"
        self._rng = np.random.default_rng([seed, 77])

    def start(self, context) -> None:
        self.engine.reset()
        self.logits = self.engine.prefill(list(context))

    def extend(self, tokens) -> None:
        for t in tokens:
            self.logits = self.engine.decode(int(t))

    def draft(self, n: int) -> Draft:
        held, logits, out, rows = self.engine.length, self.logits, [], []
        for _ in range(min(n, self.depth)):
            if self.temperature == 0:
                token = int(np.argmax(logits))
            else:
                q = probabilities(logits, SamplerConfig(self.temperature))
                token = int(self._rng.choice(len(q), p=q))
                rows.append(q)
            out.append(token)
            logits = self.engine.decode(token)
        self.engine.trim(held)
        return Draft(tuple(out), np.stack(rows) if rows else None)


class WrongDrafter:
    """Always proposes a token the model does not pick greedily (the rejection path)."""

    name = "wrong"

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def start(self, context) -> None:
        self.last = int(context[-1])

    def extend(self, tokens) -> None:
        self.last = int(tokens[-1])

    def draft(self, n: int) -> Draft:
        return Draft(tuple((self.last + 1 + i) % 7 for i in range(min(n, self.depth))))






def drafter_of(name: str, model):
    """(config changes, drafter or None: the config's own)."""
    if name.startswith("suffix"):
        return {"suffix_draft": int(name[-1])}, None
    if name == "right":
        return {"window": 4}, ModelDrafter(open_engine(model, EXACT0.replace(backend=Backend.NUMPY), stream=False), 3)
    return {"window": 4}, WrongDrafter(3)


KINDS = ["reference", "numpy-full", "numpy-min", "mlx-resident", "mlx-min"]
DRAFTERS = ["suffix-1", "suffix-2", "suffix-3", "right", "wrong"]


@pytest.fixture(scope="module")
def plain(model):
    """Each engine kind's greedy tokens without speculation."""
    out = {}
    for kind in KINDS:
        with open_kind(model, kind, EXACT0) as eng:
            out[kind] = strata.generate(eng, PROMPT, max_tokens=TOKENS).tokens
    return out


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_is_the_same_with_speculation(model, plain, kind, drafter):
    changes, custom = drafter_of(drafter, model)
    config = EXACT0.replace(**changes)
    with open_kind(model, kind, config) as eng:
        got = strata.generate(eng, PROMPT, max_tokens=TOKENS, drafter=custom)
        assert eng.length == len(PROMPT) + TOKENS - 1  # what plain decoding holds at the end
    assert got.tokens == plain[kind], f"{kind}, {drafter}"
    spec = got.speculation
    assert spec is not None and spec.tokens == TOKENS - 1  # every token after the first came from a window
    if drafter == "right":
        assert spec.acceptance > 0.9 and spec.tokens_per_window > 3
    elif drafter == "wrong":
        assert spec.accepted == 0 and spec.drafted > 0
    else:
        assert spec.drafted > 0


class CallEndSnapshots(ReferenceEngine):
    """A reference engine that, like a recurrent layer without per-position snapshots, can
    restore only positions where a call ended."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.ends = {0}

    def _forward(self, tokens, **kw):
        out = super()._forward(tokens, **kw)
        self.ends.add(self.length + len(tokens))
        return out

    def kept_position(self, n: int) -> int:
        return max(e for e in self.ends if e <= min(n, self.length))

    def _truncate(self, n: int) -> None:
        super()._truncate(n)
        self.ends = {e for e in self.ends if e <= n}


def test_an_engine_that_restores_fewer_positions_gives_the_same_output(model, plain):
    eng = CallEndSnapshots(model.resident_params(), model=model, config=EXACT0.replace(suffix_draft=3))
    got = strata.generate(eng, PROMPT, max_tokens=TOKENS)
    assert got.tokens == plain["reference"]
    assert got.speculation.accepted < got.speculation.drafted
    assert eng.stats().decode_tokens > got.speculation.positions  # rejected windows were cut back and re-run


# ---------------------------------------------------------------- the distribution

SAMPLER = dict(temperature=0.15, top_p=0.9)  # 8 first tokens, ~80 three-token sequences
DRAWS = 2000


def exact_tree(model, n_tokens: int) -> tuple[dict, dict]:
    """The sampler's probability of every sequence of the first n tokens (joint), and its
    next-token distribution after every shorter prefix (conditionals [V]): a tree of decodes."""
    cfg = SamplerConfig(**SAMPLER)
    eng = open_engine(model, EXACT0.replace(backend=Backend.NUMPY), stream=False)
    joint, conditionals = {}, {}

    def walk(prefix, logits, mass):
        if len(prefix) == n_tokens:
            joint[tuple(prefix)] = mass
            return
        p = conditionals[tuple(prefix)] = probabilities(logits, cfg)
        for t in np.nonzero(p)[0].tolist():
            eng.trim(len(PROMPT) + len(prefix))
            walk(prefix + [t], eng.decode(t) if len(prefix) + 1 < n_tokens else None, mass * p[t])

    walk([], eng.prefill(PROMPT), 1.0)
    eng.close()
    return joint, conditionals


class TreeDrafter:
    """Drafts from the exact conditionals after the generated prefix, as a good draft model
    would: their argmax (a point mass), or (sampled) a draw from q = p^(1/2), renormalized: the
    same support, flatter, so drafts are often but not always accepted."""

    name = "tree"

    def __init__(self, conditionals: dict, depth: int, sampled: bool, seed: int) -> None:
        self.conditionals, self.depth, self.sampled = conditionals, depth, sampled
        self.rng = np.random.default_rng([seed, 77])

    def start(self, context) -> None:
        self.generated = list(context)[len(PROMPT):]

    def extend(self, tokens) -> None:
        self.generated += [int(t) for t in tokens]

    def draft(self, n: int) -> Draft:
        prefix, out, rows = list(self.generated), [], []
        while len(out) < min(n, self.depth) and tuple(prefix) in self.conditionals:
            p = self.conditionals[tuple(prefix)]
            if self.sampled:
                q = np.sqrt(p) / np.sqrt(p).sum()
                token = int(self.rng.choice(len(q), p=q))
                rows.append(q)
            else:
                token = int(np.argmax(p))
            out.append(token)
            prefix.append(token)
        return Draft(tuple(out), np.stack(rows) if rows else None)


@pytest.fixture(scope="module")
def tree(model):
    return exact_tree(model, 3)


@pytest.mark.parametrize("sampled", [False, True], ids=["point-mass", "sampled-q"])
def test_sampled_output_has_the_models_distribution(model, tree, sampled):
    joint, conditionals = tree
    config = EXACT0.replace(backend=Backend.NUMPY, window=3)
    counts: dict[tuple[int, ...], int] = {}
    drafted = accepted = 0
    with open_engine(model, config, stream=False) as eng:
        for seed in range(DRAWS):
            drafter = TreeDrafter(conditionals, 2, sampled, seed)
            got = strata.generate(eng, PROMPT, max_tokens=3, seed=seed, drafter=drafter, **SAMPLER)
            key = tuple(got.tokens)
            assert key in joint, f"seed {seed}: {key} has probability 0"
            counts[key] = counts.get(key, 0) + 1
            drafted, accepted = drafted + got.speculation.drafted, accepted + got.speculation.accepted
    assert 0.1 * drafted < accepted < 0.9 * drafted  # both branches of the acceptance rule, often
    big = sorted(k for k, p in joint.items() if p * DRAWS >= 5)
    observed = [counts.get(k, 0) for k in big] + [DRAWS - sum(counts.get(k, 0) for k in big)]
    expected = [joint[k] * DRAWS for k in big] + [DRAWS * (1 - sum(joint[k] for k in big))]
    assert len(big) >= 10  # enough cells for the test to see a wrong distribution
    assert chisquare(observed, expected).pvalue > CHI_SQUARE_P


def test_sampled_tokens_with_the_gate_closed_are_the_plain_draws(model):
    """A window without a draft decides its token by `sample`, as plain decoding does."""
    config = EXACT0.replace(backend=Backend.NUMPY)
    with open_engine(model, config, stream=False) as eng:
        want = strata.generate(eng, PROMPT, max_tokens=12, seed=5, **SAMPLER).tokens
        got = strata.generate(eng, PROMPT, max_tokens=12, seed=5, drafter=WrongDrafter(0), **SAMPLER)
    assert got.tokens == want and got.speculation.drafted == 0


def test_the_cli_speculates_and_reports(model, tmp_path, capsys):
    import json

    from strata.cli.main import main

    args = ["generate", str(model.model_path), bytes(PROMPT).decode(), "-n", "12", "--backend", "numpy",
            "--moce-lambda", "0", "--report-json", str(tmp_path / "r.json")]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--suffix-draft", "2", "--no-spec-gate"]) == 0
    out, err = capsys.readouterr()
    assert out == plain and "speculation (suffix-2, gate measuring)" in err
    assert json.loads((tmp_path / "r.json").read_text())["speculation"]["drafter"] == "suffix-2"
