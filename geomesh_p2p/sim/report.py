"""Tables, JSON and plots of simulator results.

Which figures are *charged* (virtual time from the profile's reference workload) and which are
*trained* (the proxy model really trained) is said in every table header and in the JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from geomesh_p2p.sim.engine import MethodResult

__all__ = ["COLUMNS", "summaries", "format_table", "rich_table", "to_json", "plot", "dump_json"]

#: (key, header, format, charged?) of the table
COLUMNS = [
    ("method", "method", "{}", None),
    ("time_to_target_h", "time to target [h]", "{:.3f}", True),
    ("speedup", "x diloco", "{:.2f}", True),
    ("tokens_to_target_M", "ref tokens to target [M]", "{:.1f}", False),
    ("final_ppl", "final ppl", "{:.2f}", False),
    ("straggler_idle_fastest_pct", "straggler idle fastest %", "{:.1f}", True),
    ("network_idle_pct", "network idle %", "{:.1f}", True),
    ("gb_sent_per_peer", "GB sent/peer", "{:.2f}", True),
    ("compute_util_pct", "compute util %", "{:.1f}", True),
    ("rounds", "rounds", "{}", None),
    ("total_h", "run [h]", "{:.3f}", True),
]


def summaries(results: Sequence[MethodResult], target_ppl: Optional[float]) -> list[dict[str, Any]]:
    """One summary dict per method; ``speedup`` = diloco's time to target / this method's."""
    rows = [r.summary(target_ppl) for r in results]
    base = next((r["time_to_target_h"] for r in rows if r["method"] == "diloco"), None)
    for r in rows:
        t = r["time_to_target_h"]
        r["speedup"] = (base / t) if (base and t) else None
        r["time_ratio_vs_diloco"] = (t / base) if (base and t) else None
    return rows


def _cell(fmt: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def format_table(rows: Sequence[dict[str, Any]], title: str = "") -> str:
    """A plain-text (Markdown) table of the summaries."""
    head = [h for _, h, _, _ in COLUMNS]
    body = [[_cell(f, r.get(k)) for k, _, f, _ in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = []
    if title:
        lines.append(title)
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for b in body:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(b, widths)) + " |")
    return "\n".join(lines)


def rich_table(rows: Sequence[dict[str, Any]], title: str = ""):
    """A rich Table: charged columns in cyan, trained (perplexity) in green."""
    from rich.table import Table

    t = Table(
        title=title,
        caption="cyan: charged (virtual time of the reference workload) - green: trained (proxy model perplexity)",
    )
    for k, h, _, charged in COLUMNS:
        style = "cyan" if charged else ("green" if charged is False else None)
        t.add_column(h, style=style, justify="left" if k == "method" else "right")
    for r in rows:
        t.add_row(*[_cell(f, r.get(k)) for k, _, f, _ in COLUMNS])
    return t


def to_json(
    results: Sequence[MethodResult],
    rows: Sequence[dict[str, Any]],
    *,
    profile,
    target_ppl,
    target_source: str,
    command: str,
    budget_ref: int,
    diloco_tokens_per_round: int,
    numel: int,
) -> dict[str, Any]:
    """Everything needed to redraw the plots and check the tables."""
    return {
        "command": command,
        "profile": profile.model_dump(mode="json"),
        "target_ppl": target_ppl,
        "target_source": target_source,
        "token_budget_ref": budget_ref,
        "diloco_tokens_per_round_ref": diloco_tokens_per_round,
        "proxy_params": numel,
        "charged": [
            "time_to_target_h",
            "straggler_idle_fastest_pct",
            "network_idle_pct",
            "gb_sent_per_peer",
            "compute_util_pct",
            "total_h",
            "round_s",
            "bytes",
        ],
        "trained": ["final_ppl", "best_ppl", "curve ppl", "train_loss"],
        "summaries": list(rows),
        "methods": {
            r.spec.label: {
                "spec": r.spec.__dict__,
                "plan": r.plan_info,
                "curve": [{"t_h": t / 3600.0, "ppl": p, "tokens_ref": n} for t, p, n in r.curve],
                "per_peer": [
                    {
                        "name": pe.name,
                        "gpu": pe.gpu,
                        "compute_s": c,
                        "straggler_s": s,
                        "network_s": nw,
                        "sent": snt,
                        "received": rcv,
                    }
                    for pe, c, s, nw, snt, rcv in zip(
                        r.peers, r.compute_s, r.straggler_s, r.network_s, r.sent, r.received
                    )
                ],
                "rounds": [
                    {
                        "i": lg.index,
                        "t_end_s": lg.t_end_s,
                        "round_s": lg.round_s,
                        "window_s": lg.window_s,
                        "inner_steps": lg.inner_steps,
                        "tokens_ref": lg.tokens_ref,
                        "tokens_trained": lg.tokens_trained,
                        "train_loss": lg.train_loss,
                        "eval_ppl": lg.eval_ppl,
                        "staleness": lg.staleness,
                        "peer": lg.peer,
                    }
                    for lg in r.rounds
                ],
            }
            for r in results
        },
    }


def plot(
    results: Sequence[MethodResult],
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    target_ppl: Optional[float],
    title: str = "",
) -> None:
    """Two panels: eval perplexity (trained) against virtual hours (charged) for every method, and
    the fastest peer's time split into compute / straggler idle / network idle / other (charged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14.5, 5.4), gridspec_kw={"width_ratios": [1.35, 1]})
    cmap = plt.get_cmap("tab10")
    ends = [r.curve[-1][0] for r in results if len(r.curve) > 1 and r.curve[-1][0] > 0]
    logx = bool(ends) and max(ends) / min(ends) > 8  # e.g. volunteer32: 1.25 h against 0.06 h
    for k, r in enumerate(results):
        pts = [(t / 3600.0, p) for t, p, _ in r.curve if not (logx and t <= 0)]
        ax1.plot(
            [a for a, _ in pts],
            [b for _, b in pts],
            label=r.spec.label,
            color=cmap(k % 10),
            lw=1.6,
            marker="o" if len(pts) < 4 else None,
            ms=4,
        )
    if logx:
        ax1.set_xscale("log")
    if target_ppl:
        ax1.axhline(target_ppl, color="0.4", ls="--", lw=1)
        ax1.text(
            ax1.get_xlim()[1], target_ppl, f" target {target_ppl:.1f}", va="bottom", ha="right", fontsize=8, color="0.3"
        )
    ax1.set_yscale("log")
    all_ppl = [p for r in results for _, p, _ in r.curve]
    if all_ppl:
        # from the best value to what most methods show a fifth into their run (a diverging method
        # leaves the frame instead of squashing the others)
        lo = min(all_ppl)
        fifth = sorted(r.curve[max(1, len(r.curve) // 5)][1] for r in results if len(r.curve) > 1)
        hi = fifth[len(fifth) // 2] if fifth else max(all_ppl)
        ax1.set_ylim(lo * 0.93, max(hi * 2.2, lo * 1.5))
    ax1.set_xlabel("virtual time [h] (charged: reference workload)" + (", log scale" if logx else ""))
    ax1.set_ylabel("eval perplexity (trained: proxy model)")
    ax1.set_title("Perplexity vs virtual time")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)

    labels = [r["method"] for r in rows]
    comp = [r["compute_fastest_pct"] for r in rows]
    strag = [r["straggler_idle_fastest_pct"] for r in rows]
    net = [r["network_idle_fastest_pct"] for r in rows]
    other = [max(0.0, 100.0 - c - s - n) for c, s, n in zip(comp, strag, net)]
    x = list(range(len(rows)))
    ax2.bar(x, comp, color="#4c9a2a", label="compute")
    ax2.bar(x, strag, bottom=comp, color="#e69f00", label="straggler idle")
    b2 = [c + s for c, s in zip(comp, strag)]
    ax2.bar(x, net, bottom=b2, color="#0072b2", label="network idle")
    b3 = [b + n for b, n in zip(b2, net)]
    if any(o > 0.05 for o in other):
        ax2.bar(x, other, bottom=b3, color="0.8", label="other (async: unfinished work)")
    for xi, (c, s, n) in enumerate(zip(comp, strag, net)):
        ax2.text(xi, 101, f"{s:.1f}/{n:.1f}", ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(x)
    ax2.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax2.set_ylim(0, 112)
    ax2.set_ylabel("% of the run (fastest peer)")
    fastest = results[0].peers[results[0].fastest].name if results else ""
    ax2.set_title(f"Where the fastest GPU's time goes ({fastest})\nlabels: straggler/network idle %", fontsize=10)
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _clean(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if o is None or isinstance(o, (str, int, bool)):
        return o
    return str(o)


def dump_json(obj: dict[str, Any], path: str | Path) -> None:
    """Strict JSON (NaN/inf written as null)."""
    Path(path).write_text(json.dumps(_clean(obj), indent=1, allow_nan=False))
