"""The quality suite's table and plot, straight from its JSON (no number typed by hand).

Runs in the benchmark process (``benchmarks/quality_suite.py``).
"""
from __future__ import annotations

from pathlib import Path


def split(policy: str) -> tuple[str, int | None]:
    """("window+pool", 256) from "window+pool@c256"; None: the prompt held whole."""
    base, _, chunk = policy.partition("@c")
    return base, int(chunk) if chunk else None


def markdown_table(result: dict) -> str:
    """One row per (policy, budget, chunk): each task's score, the suite score and its ratio
    to the full cache's; perplexity columns when the run has them."""
    pols = result["policies"]
    tasks = list(pols["full"]["tasks"])
    texts = list(pols["full"].get("ppl", {}))
    n = pols["full"]["num_samples"]
    dead = pols["full"].get("dead_tasks", [])
    head = ["policy", "budget", "prefill chunk",
            *(f"{t} (n={n[t]}{', full 0: not in suite' if t in dead else ''})" for t in tasks), "suite", "x full",
            *(f"ppl {t}" for t in texts)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in pols.values():
        policy, chunk = split(entry["policy"])
        ratio = entry["suite_ratio_to_full"]
        cells = ["full cache" if policy == "full" else policy,
                 "-" if entry["budget"] is None else f"{round(entry['budget'] * 100)}%",
                 "-" if policy == "full" else (str(chunk) if chunk else "whole"),
                 *(f"{entry['tasks'][t]:.2f}" for t in tasks), f"**{entry['suite']:.3f}**",
                 "" if ratio is None else f"{ratio:.2f}"]
        for t in texts:
            ppl = entry.get("ppl", {}).get(t)
            cells.append("" if ppl is None else f"{ppl['ppl']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Suite score against the budget, one panel per prefill chunk (the prompt held whole
    first), one line per policy; the full cache's score as a black line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    pols = [e for e in result["policies"].values() if e["policy"] != "full"]
    if not pols:  # the full cache alone: nothing to draw against it
        return
    chunks = sorted({split(e["policy"])[1] for e in pols}, key=lambda c: (c is not None, c or 0))
    names = list(dict.fromkeys(split(e["policy"])[0] for e in pols))
    colors = {p: f"C{i % 10}" for i, p in enumerate(names)}
    fig, axes = plt.subplots(1, len(chunks), figsize=(5 * len(chunks), 4.2), squeeze=False)
    full = result["policies"]["full"]["suite"]
    for ax, chunk in zip(axes[0], chunks):
        for name in names:
            rows = sorted((e for e in pols if split(e["policy"]) == (name, chunk)), key=lambda e: e["budget"])
            ax.plot([e["budget"] for e in rows], [e["suite"] for e in rows], color=colors[name], marker="o", ms=3)
        ax.axhline(full, color="k", lw=0.8)
        ax.set(title="prompt held whole" if chunk is None else f"prefill_chunk {chunk}",
               xlabel="budget (fraction of the prompt)", ylabel="suite score (mean task accuracy)", ylim=(0, 1))
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colors[p], marker="o", ms=3) for p in names] + [Line2D([], [], color="k", lw=0.8)]
    fig.legend(handles, [{"h2o": "H2O (paper)"}.get(p, p) for p in names] + ["full cache"],
               loc="lower center", ncol=min(len(names) + 1, 6), fontsize=8)
    fig.suptitle(f"{Path(result['meta']['model']).name}: long-context quality suite vs KV budget", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
