"""PNG plots for the analysis kit (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

__all__ = ["plot_capacity_sweep", "plot_policy_table"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_capacity_sweep(results, path: str | Path, *, belady=(), total_experts: int | None = None,
                        title: str = "urgent misses vs arena capacity") -> Path:
    """Urgent misses per token vs capacity, one line per configuration (everything but the
    capacity), Belady MIN bounds dashed.

    results: ReplayResults; belady: (label, BeladyResult) pairs; total_experts (L·E) adds a
    secondary axis in percent of all experts.
    """
    plt = _pyplot()
    lines: dict[str, list] = defaultdict(list)
    for r in results:
        lines[r.label].append((r.config.capacity, r.urgent_per_token))
    bounds: dict[str, list] = defaultdict(list)
    for label, b in belady:
        bounds[label].append((b.capacity, b.misses_per_token))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label, pts in lines.items():
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, marker="o", label=label)
    for label, pts in bounds.items():
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, linestyle="--", marker="x", label=f"Belady MIN ({label})")
    ax.set_xlabel("arena capacity (slots)")
    ax.set_ylabel("urgent misses / token")
    _log_y(ax, [y for pts in list(lines.values()) + list(bounds.values()) for _, y in pts])
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    if total_experts:
        sec = ax.secondary_xaxis("top", functions=(lambda c: 100.0 * c / total_experts,
                                                   lambda p: p * total_experts / 100.0))
        sec.set_xlabel("% of all experts resident")
    return _save(fig, path, plt)


def plot_policy_table(rows, path: str | Path, *, title: str = "MoCE: misses vs quality (J × λ)") -> Path:
    """Two panels, urgent misses per token against routed relMSE and against mean KLD, one
    point per (J, λ), annotated. rows: dicts with label, urgent_per_token, relmse, kld_mean."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, key, name in ((axes[0], "relmse", "routed-output relMSE vs λ = 0"),
                          (axes[1], "kld_mean", "mean KLD vs λ = 0 (nats)")):
        for row in rows:
            ax.scatter(row[key], row["urgent_per_token"], s=24)
            ax.annotate(row["label"], (row[key], row["urgent_per_token"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(name)
        ax.set_ylabel("urgent misses / token")
        _log_y(ax, [row["urgent_per_token"] for row in rows])
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    return _save(fig, path, plt)


def _log_y(ax, ys) -> None:
    """Misses span orders of magnitude (λ = 0 vs MoCE, small vs large arenas): a log axis, or
    symlog when some run has none."""
    ys = [y for y in ys if y == y]
    if ys and max(ys) > 0:
        if min(ys) > 0:
            ax.set_yscale("log")
        else:
            ax.set_yscale("symlog", linthresh=max(min((y for y in ys if y > 0), default=0.01), 1e-3))


def _save(fig, path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
