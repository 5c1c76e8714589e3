"""Which sampling settings keep the embedded model out of loops: the measurement behind the demo
defaults (`strata generate PROMPT` on the embedded model with no sampling flag; docs/model-card.md).

    python scripts/measure_demo_defaults.py            # ~4 minutes on one CPU core

For each setting, each prompt and each seed, 100 tokens are generated (the CLI's default -n) and
scored by their repeated 4-gram share: 1 - distinct 4-grams / 4-grams over the generated tokens
(0: nothing repeats; a greedy loop "figure of a figure of ..." scores near 1). A run counts as
looping when the share is over LOOP_SHARE. Prints a table and one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import strata  # noqa: E402

PROMPTS = ["def fibonacci(n):", "def quicksort(xs):", "class Stack:", "import os\n", "def read_config(path):"]
SEEDS = (0, 1, 2)
TOKENS = 100
LOOP_SHARE = 0.5  # half the 4-grams repeats of earlier ones: the text is going round
SETTINGS = {
    "greedy": {},
    "greedy, repeat-penalty 1.1": {"repeat_penalty": 1.1},
    "greedy, repeat-penalty 1.3": {"repeat_penalty": 1.3},
    "temp 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temp 0.7, top-p 0.9, repeat-penalty 1.1": {"temperature": 0.7, "top_p": 0.9, "repeat_penalty": 1.1},
    "temp 0.7, top-p 0.9, repeat-penalty 1.2": {"temperature": 0.7, "top_p": 0.9, "repeat_penalty": 1.2},
    "temp 0.7, top-p 0.9, repeat-penalty 1.3": {"temperature": 0.7, "top_p": 0.9, "repeat_penalty": 1.3},
    "temp 0.8, top-k 40, min-p 0.05, repeat-penalty 1.1": {"temperature": 0.8, "top_k": 40, "min_p": 0.05,
                                                          "repeat_penalty": 1.1},
}


def repeated_share(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def heldout_reference(model) -> dict:
    """The same score on real code: heldout.txt (library code the model never saw) in windows of
    TOKENS tokens. A setting far below it has been pushed off the repetition code really has."""
    from strata.default_model import EMBEDDED

    ids = model.tokenizer.encode((EMBEDDED.parent / "heldout.txt").read_text(encoding="utf-8"))
    shares = [repeated_share(ids[i:i + TOKENS]) for i in range(0, len(ids) - TOKENS, TOKENS)]
    return {"runs": len(shares), "mean_repeated_4gram_share": round(sum(shares) / len(shares), 3),
            "looping_runs": sum(x > LOOP_SHARE for x in shares), "worst": round(max(shares), 3)}


def main() -> int:
    model = strata.load("default")
    rows = {"held-out code (reference)": heldout_reference(model)}
    r = rows["held-out code (reference)"]
    print("| setting | runs | mean repeated 4-gram share | worst | looping runs |")
    print(f"| held-out code (reference) | {r['runs']} | {r['mean_repeated_4gram_share']:.3f} | {r['worst']:.3f} | "
          f"{r['looping_runs']} |", flush=True)
    for name, kwargs in SETTINGS.items():
        seeds = SEEDS if kwargs.get("temperature") else (0,)  # greedy does not depend on the seed
        shares = [repeated_share(strata.generate(model, p, max_tokens=TOKENS, seed=s, **kwargs).tokens)
                  for p in PROMPTS for s in seeds]
        rows[name] = {"runs": len(shares), "mean_repeated_4gram_share": round(sum(shares) / len(shares), 3),
                      "looping_runs": sum(x > LOOP_SHARE for x in shares), "worst": round(max(shares), 3)}
        r = rows[name]
        print(f"| {name} | {r['runs']} | {r['mean_repeated_4gram_share']:.3f} | {r['worst']:.3f} | "
              f"{r['looping_runs']} |", flush=True)
    print(json.dumps({"benchmark": "demo_defaults", "tokens": TOKENS, "prompts": PROMPTS, "settings": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
