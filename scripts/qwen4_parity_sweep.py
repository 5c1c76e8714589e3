"""Sweep Qwen4-Exp's configuration space against transformers: for each seed, the checkpoint
tests/hf_qwen4_random.py draws for it (built, noised, trained, saved in BF16), transformers' float32
logits over the parity text and its 32 greedy tokens, and strata's (converted with f32 experts).
Needs torch (the `regen` extra). Each seed is classified:

    agree      logits within FLOAT32_REORDER_OF_SCALE of the scale and the same greedy tokens
    tie        they differ, and transformers' QSA selection met an exact tie (torch.topk picks
               among equal block scores in no defined order: docs/qwen4.md)
    DISAGREE   they differ with no tie: a parity bug to find

    python scripts/qwen4_parity_sweep.py --seeds 100 149                   # the fixtures' space
    python scripts/qwen4_parity_sweep.py --seeds 100 149 --indexer-heads 4 --no-train  # ties are common

Prints a line per seed, then a summary as one JSON line. Exit status 1 if any seed is DISAGREE.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import hf_qwen4_random, hf_reference  # noqa: E402
from tests.budgets import FLOAT32_REORDER_OF_SCALE  # noqa: E402


def transformers_ties(model, tokens) -> int:
    """How many of transformers' QSA block selections over `tokens` met an exact tie at the edge
    of the chosen set (the indexer calls `scores.topk(k, dim=0)` on a 1-D score vector)."""
    import torch

    ties = 0
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, *args, **kw):
        nonlocal ties
        if self.dim() == 1 and dim == 0 and k < self.numel():
            ordered = torch.sort(self, descending=True).values
            ties += bool(ordered[k - 1] == ordered[k])
        return original(self, k, dim, *args, **kw)

    torch.Tensor.topk = topk
    try:
        hf_reference.logits(model, tokens)
    finally:
        torch.Tensor.topk = original
    return ties


def sweep_one(seed: int, work: Path, overrides: dict, train: bool) -> dict:
    from strata.convert import convert
    from strata.formats.quant_types import QuantType
    from strata.generate import generate
    from strata.loader import load
    from tests.convert_parity import reference_logits

    arch = f"{hf_qwen4_random.PREFIX}{seed}"
    d = work / arch
    model = hf_qwen4_random.build_checkpoint(arch, d, train=train, **overrides)
    tokens = hf_reference.parity_tokens(d)
    ref = hf_reference.logits(model, tokens)
    prompt = tokens[:8]
    theirs = hf_reference.greedy(model, prompt, hf_reference.eos_ids(d))
    r = convert(d, work / f"{arch}.strata", expert_type=QuantType.F32)
    with load(r.model_path) as m:
        got = reference_logits(m, np.asarray(tokens))
        ours = generate(m, prompt, max_tokens=len(theirs)).tokens
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    same = err <= FLOAT32_REORDER_OF_SCALE and ours == theirs
    ties = 0 if same else transformers_ties(model, tokens)
    verdict = "agree" if same else ("tie" if ties else "DISAGREE")
    return {"seed": seed, "verdict": verdict, "max_rel_logit_error": err, "greedy_same": ours == theirs,
            "tied_selections": ties, "output_gate": hf_qwen4_random.output_gate_type(seed) or "unset"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs=2, type=int, default=(100, 119), metavar=("FIRST", "LAST"))
    parser.add_argument("--indexer-heads", type=int, default=None, help="override the drawn indexer head count")
    parser.add_argument("--no-train", action="store_true", help="keep the initialized (and noised) weights")
    args = parser.parse_args(argv)
    hf_reference.setup_torch()
    overrides = {} if args.indexer_heads is None else {"indexer_n_heads": args.indexer_heads}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds[0], args.seeds[1] + 1):
            row = sweep_one(seed, Path(tmp), overrides, not args.no_train)
            rows.append(row)
            print(f"seed {seed:4d}  {row['verdict']:8s}  max|dlogit|/scale {row['max_rel_logit_error']:.2e}  "
                  f"greedy {'same' if row['greedy_same'] else 'differs'}  tied selections {row['tied_selections']}  "
                  f"gate {row['output_gate']}",
                  flush=True)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("agree", "tie", "DISAGREE")}
    print(json.dumps({"sweep": "qwen4_parity", "seeds": list(args.seeds), "overrides": overrides,
                      "trained": not args.no_train, **counts,
                      "sigmoid_gates": sum(r["output_gate"] == "sigmoid" for r in rows),
                      "worst_agreeing_error": max((r["max_rel_logit_error"] for r in rows
                                                   if r["verdict"] == "agree"), default=None)}))
    return 1 if counts["DISAGREE"] else 0


if __name__ == "__main__":
    sys.exit(main())
