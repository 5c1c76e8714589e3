"""Tables for the analysis kit, as aligned text (terminal) or Markdown (docs): the reference engine's
columns, one row per configuration."""

from __future__ import annotations

__all__ = ["table", "replay_rows", "recall_rows", "sweep_rows"]


def table(header: list[str], rows: list[list], *, markdown: bool = False) -> str:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def _fmt(c) -> str:
    if isinstance(c, float):
        if c != c:
            return "-"
        return f"{c:.4f}" if abs(c) < 0.1 and c != 0 else f"{c:.2f}"
    return str(c)


def replay_rows(results, *, opt: dict | None = None, total_experts: int | None = None) -> tuple[list, list]:
    """The reference engine's §1.1 table: policy, cap, urgent misses/token, read-ahead hits/token, reads/token,
    hit rate, misses by selected rank/token (and Belady MIN/token on the same routed stream)."""
    header = ["policy", "cap (slots)"] + (["cap %"] if total_experts else []) + [
        "urgent miss/tok", "read-ahead hits/tok", "reads/tok", "hit rate", "miss by selected rank /tok"]
    if opt:
        header.append("Belady/tok")
    rows = []
    for i, r in enumerate(results):
        row = [r.label, r.config.capacity]
        if total_experts:
            row.append(f"{100.0 * r.config.capacity / total_experts:.1f}")
        row += [r.urgent_per_token, r.readahead_hits_per_token, r.reads_per_token, f"{100 * r.hit_rate:.2f}%",
                " ".join(f"{x:.1f}" for x in r.misses_by_rank_per_token)]
        if opt:
            b = opt.get(i)
            row.append(b.misses_per_token if b is not None else float("nan"))
        rows.append(row)
    return header, rows


def recall_rows(results) -> tuple[list, list]:
    header = ["guess", "K", "recall@K", "top-1 in top-K", "weight recall@K"]
    rows = []
    for r in results:
        for k in r.recall:
            rows.append([f"W(l+{r.ahead})·h(l)", k, r.recall[k], r.top1[k], r.weight_recall[k]])
    return header, rows


def sweep_rows(rows: list[dict]) -> tuple[list, list]:
    header = ["policy", "urgent miss/tok (replay)", "Δ vs stock", "urgent miss/tok (decode)", "routed relMSE",
              "rel-L2", "KLD mean", "KLD p99", "KLD max", "ppl"]
    out = []
    for r in rows:
        d = r["delta_vs_stock"]
        out.append([r["label"], r["urgent_per_token"], "-" if d != d else f"{100 * d:+.0f}%",
                    r["urgent_per_token_decode"], f"{r['relmse']:.3g}", f"{r['rel_l2']:.3g}", f"{r['kld_mean']:.3g}",
                    f"{r['kld_p99']:.3g}", f"{r['kld_max']:.3g}", r["ppl"]])
    return header, out
