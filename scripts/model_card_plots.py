"""The numbers and figures of docs/model-card.md, from the shipped model and its training log.

    python scripts/model_card_plots.py                 # figures + routing statistics (~2 min on one core)
    python scripts/model_card_plots.py --hf HF_DIR     # also: perplexity at f16 / q8_0 / q4_0 / q2_0 experts
                                                     # (each converted from HF_DIR by `strata convert`)
                                                     # and of the untrained model (~10 min)

Writes docs/img/loss.png (training loss and held-out loss against tokens seen, from
strata/data/default.train.json), docs/img/expert_usage.png (how often each expert of each
layer is selected on strata/data/heldout.txt) and docs/img/model_card_stats.json (everything
printed). Perplexity is teacher-forced over heldout.txt in windows of WINDOW tokens, each
from an empty cache, through strata's reference forward: the path every backend is tested
against.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

import strata
from strata.formats.quant_types import QuantType
from strata.reference.model import ModelParams, ModelState, forward
from strata.testing.models import make_dense, make_expert
from strata.tools.trace import record_trace

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "strata" / "data"
IMG = ROOT / "docs" / "img"
WINDOW = 512  # the training sequence length
EXPERT_TYPES = ("f16", "q8_0", "q4_0", "q2_0")
UNTRAINED_SEED = 0


def windows(ids: list[int]) -> list[np.ndarray]:
    return [np.asarray(ids[s:s + WINDOW], np.int64) for s in range(0, len(ids), WINDOW) if len(ids) - s >= 2]


def perplexity(params: ModelParams, ids: list[int]) -> tuple[float, int]:
    """exp(mean next-token NLL) over all windows, and the number of tokens scored."""
    nll, count = 0.0, 0
    for x in windows(ids):
        logits, _ = forward(params, ModelState.empty(params.cfg), x)
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(x) - 1), x[1:]].sum())
        count += len(x) - 1
    return math.exp(nll / count), count


class RandomExperts:
    """The untrained baseline's experts: strata.testing.models's random Q2_0 experts, made on demand."""

    def __init__(self, cfg, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    @lru_cache(maxsize=None)
    def expert(self, layer: int, expert: int):
        return make_expert(self.cfg, self.seed, layer, expert, QuantType.Q2_0)


def untrained_params(cfg) -> ModelParams:
    """The same architecture with random weights (strata.testing.models's builder)."""
    return ModelParams(cfg, make_dense(cfg, UNTRAINED_SEED), RandomExperts(cfg, UNTRAINED_SEED))


def routing_stats(model, ids: list[int]) -> tuple[np.ndarray, dict]:
    """Expert usage counts [L, E] and summary statistics of the model's own (λ = 0) routing."""
    params = model.resident_params()
    cfg = params.cfg
    k, n_exp = cfg.n_experts_per_token, cfg.n_experts
    usage = np.zeros((cfg.n_layers, n_exp), np.int64)
    overlap, margins, top_gap, lse = [], [], [], []
    for x in windows(ids):
        tr = record_trace(params, x, decode_order=False)
        sel = tr.selected  # [T, L, k]
        for l in range(cfg.n_layers):
            usage[l] += np.bincount(sel[:, l].ravel(), minlength=n_exp)
        same = (sel[1:, :, :, None] == sel[:-1, :, None, :]).any(-1).sum(-1)  # [T-1, L]
        overlap.append(same / k)
        z = np.sort(tr.logits, axis=-1)[..., ::-1]  # [T, L, E] descending
        margins.append(z[..., k - 1] - z[..., k])  # last selected vs first unselected
        top_gap.append(z[..., 0] - z[..., 1])
        lse.append(z[..., 0] - z[..., -1])
    overlap, margins = np.concatenate(overlap), np.concatenate(margins)
    top_gap, spread = np.concatenate(top_gap), np.concatenate(lse)
    share = np.sort(usage, axis=1)[:, ::-1] / usage.sum(axis=1, keepdims=True)
    n_top = n_exp // 8
    stats = {
        "tokens": int(sum(len(x) for x in windows(ids))),
        "top_eighth_share": float(share[:, :n_top].sum(1).mean()),  # uniform: 0.125
        "max_over_uniform": float((share[:, 0] * n_exp).mean()),
        "min_over_uniform": float((share[:, -1] * n_exp).mean()),
        "unused_experts": int((usage == 0).sum()),
        "consecutive_overlap": float(overlap.mean()),  # uniform random routing: k / E
        "consecutive_overlap_random": k / n_exp,
        "consecutive_overlap_by_layer": [round(float(v), 3) for v in overlap.mean(0)],
        "margin_k_median": float(np.median(margins)),
        "margin_k_p10": float(np.percentile(margins, 10)),
        "top1_gap_median": float(np.median(top_gap)),
        "logit_range_median": float(np.median(spread)),
    }
    return usage, stats


def plot_loss(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = log["tokens_per_step"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    tr = log["losses"]
    ax.plot([r["step"] * tps / 1e6 for r in tr], [r["loss"] for r in tr], label="training loss (mean of 25 steps)")
    ev = log["evals"]
    ax.plot([r["step"] * tps / 1e6 for r in ev], [r["loss"] for r in ev], "o-",
            label=f"held-out loss ({log['heldout_eval_tokens'] // 1024}k tokens)")
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(1.5, 8.0)
    ax.grid(alpha=0.3)
    ax.set_title(f"strata default model: {log['steps']} steps, {log['tokens_seen'] / 1e6:.1f} M tokens, "
                 f"{log['train_seconds'] / 60:.1f} min on one H200", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_usage(usage: np.ndarray, path: Path, tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_layers, n_exp = usage.shape
    share = usage / usage.sum(axis=1, keepdims=True) * n_exp  # 1.0 = uniform
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4), dpi=120, gridspec_kw={"width_ratios": [1, 1.3]})
    for l in range(n_layers):
        ax0.plot(np.arange(1, n_exp + 1), np.sort(share[l])[::-1], label=f"layer {l}", lw=1.2)
    ax0.axhline(1.0, color="k", ls="--", lw=0.8, label="uniform")
    ax0.set_yscale("log")
    ax0.set_xlabel("expert rank (most used first)")
    ax0.set_ylabel("selections / uniform share")
    ax0.set_title("usage by rank, per layer", fontsize=10)
    ax0.legend(fontsize=7, ncol=2)
    ax0.grid(alpha=0.3)
    im = ax1.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    ax1.set_xlabel("expert")
    ax1.set_ylabel("layer")
    ax1.set_title("selections / uniform share, per (layer, expert)", fontsize=10)
    fig.colorbar(im, ax=ax1)
    fig.suptitle(f"expert usage on strata/data/heldout.txt ({tokens} tokens, top-4 of 64)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def perplexities(hf_dir: Path, ids: list[int], cfg) -> dict:
    from strata.convert import convert

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in EXPERT_TYPES:
            t = time.time()
            r = convert(hf_dir, Path(tmp) / name, expert_type=QuantType[name.upper()], dense_type=QuantType.F16)
            ppl, n = perplexity(strata.load(r.model_path).resident_params(), ids)
            size = r.model_path.stat().st_size + r.experts_path.stat().st_size
            out[name] = {"perplexity": ppl, "tokens": n, "bytes": size}
            print(f"  experts {name}: perplexity {ppl:.3f} over {n} tokens; files {size / 1e6:.1f} MB "
                  f"({time.time() - t:.0f} s)", flush=True)
    ppl, n = perplexity(untrained_params(cfg), ids)
    out["untrained"] = {"perplexity": ppl, "tokens": n}
    print(f"  untrained (random weights, seed {UNTRAINED_SEED}): perplexity {ppl:.1f}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", type=Path, default=None, help="the trained checkpoint: also measure perplexity per type")
    ap.add_argument("--model", type=Path, default=DATA / "default.gguf")
    args = ap.parse_args()
    IMG.mkdir(parents=True, exist_ok=True)
    log = json.loads((DATA / "default.train.json").read_text())
    plot_loss(log, IMG / "loss.png")
    model = strata.load(args.model)
    ids = model.tokenizer.encode((DATA / "heldout.txt").read_text(encoding="utf-8"))
    t = time.time()
    usage, stats = routing_stats(model, ids)
    plot_usage(usage, IMG / "expert_usage.png", stats["tokens"])
    print(f"routing on heldout.txt ({time.time() - t:.0f} s): {json.dumps(stats, indent=1)}", flush=True)
    summary = {"routing": stats}
    stats_path = IMG / "model_card_stats.json"
    if stats_path.exists():  # keep earlier perplexities when only the figures are redone
        summary = {**json.loads(stats_path.read_text()), **summary}
    if args.hf:
        summary["perplexity"] = perplexities(args.hf, ids, model.cfg)
    stats_path.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
