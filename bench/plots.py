"""PNG plots of a `bench --suite e2e` result: acceptance lengths, tokens/s, speedup over our AR.

One panel per target, stacked; rows in the table's order. matplotlib is imported here only
(the `bench` extra), so the benchmark itself runs without it.
"""

from __future__ import annotations

from pathlib import Path

from dflow_rt.bench.report import label
from dflow_rt.errors import DflowError

COLORS = {"hf": "#8c8c8c", "ar": "#4c72b0", "reference": "#937860", "drafted": "#dd8452"}


def write_plots(result: dict, out_dir: Path, stem: str) -> list[Path]:
    """`{stem}_acceptance.png`, `{stem}_tokens_per_s.png` and `{stem}_speedup.png` in `out_dir`."""
    try:
        import matplotlib
    except ImportError:
        raise DflowError("--plots needs matplotlib: pip install 'dflow-rt[bench]'") from None
    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    by_target: dict[str, list[dict]] = {}
    for r in result["rows"]:
        by_target.setdefault(r["target"], []).append(r)
    m = result["machine"]
    caption = (f"{m['cpu']}, torch {m['torch']}, transformers {m['transformers']}, {m['date']}; "
               f"{result['settings']['prompts']} HumanEval prompts, {result['settings']['max_new_tokens']} "
               f"new tokens, greedy")
    paths = [out_dir / f"{stem}_{name}.png" for name in ("acceptance", "tokens_per_s", "speedup")]
    _acceptance(by_target, caption, paths[0])
    _bars(by_target, "tokens_per_s", "decode tokens/s (median over calls)", caption, paths[1], None)
    _bars(by_target, "speedup_vs_ar", "decode speedup over our AR at the same mode, batch and dtype "
          "(transformers and reference rows: over AR eager b1)", caption, paths[2], 1.0)
    return paths


def _kind(r: dict) -> str:
    if r["method"].startswith("hf_"):
        return "hf"
    return r["method"] if r["method"] in ("ar", "reference") else "drafted"


def _bars(by_target: dict[str, list[dict]], key: str, xlabel: str, caption: str, path: Path,
          line: float | None) -> None:
    """Horizontal bars, one per row, the value written at the end of each bar."""
    import matplotlib.pyplot as plt

    heights = [len(rows) for rows in by_target.values()]
    fig, axes = plt.subplots(len(heights), 1, figsize=(10, 1.2 + 0.27 * sum(heights) + 0.6 * len(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (target, rows) in zip(axes[:, 0], by_target.items(), strict=True):
        values = [r[key] for r in rows]
        y = range(len(rows))
        ax.barh(y, values, color=[COLORS[_kind(r)] for r in rows])
        ax.set_yticks(list(y), [label(r) for r in rows], fontsize=8)
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.2f}" if line else f" {v:.1f}", va="center", fontsize=7)
        if line is not None:
            ax.axvline(line, color="black", linewidth=0.8, linestyle="--")
        ax.set_xlim(0, 1.15 * max(values))
        ax.set_title(f"target: {target}", fontsize=10, loc="left")
        ax.set_xlabel(xlabel, fontsize=9)
    fig.suptitle(caption, fontsize=7, y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _acceptance(by_target: dict[str, list[dict]], caption: str, path: Path) -> None:
    """Share of rounds emitting 1..B tokens per drafting method, from its first batch-1 row per
    verify width (acceptance hardly depends on mode or dtype); the legend gives each tau."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(by_target), 1, figsize=(10, 3.2 * len(by_target)), squeeze=False)
    for ax, (target, rows) in zip(axes[:, 0], by_target.items(), strict=True):
        seen, shown = set(), []
        for r in rows:
            key = (r["method"], r["drafter"], r["k"])
            if len(r["acceptance_histogram"]) > 1 and r["batch"] == 1 and key not in seen:
                seen.add(key)
                shown.append(r)
        if not shown:
            ax.text(0.5, 0.5, "no drafting method ran on this target", ha="center", va="center")
            ax.set_axis_off()
            continue
        width = 0.8 / len(shown)
        for j, r in enumerate(shown):
            counts = r["acceptance_histogram"]
            total = sum(counts)
            name = " ".join(w for w in label(r).split() if w not in (r["mode"], "b1"))
            ax.bar([a + 1 + (j - (len(shown) - 1) / 2) * width for a in range(len(counts))],
                   [c / total for c in counts], width, label=f"{name} (tau {r['tau']:.2f})")
        ax.set_xticks(range(1, max(len(r["acceptance_histogram"]) for r in shown) + 1))
        ax.set_xlabel("tokens emitted per round (accepted drafts + bonus token)", fontsize=9)
        ax.set_ylabel("share of rounds", fontsize=9)
        ax.set_title(f"target: {target}", fontsize=10, loc="left")
        ax.legend(fontsize=7)
    fig.suptitle(caption, fontsize=7, y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=120)
    plt.close(fig)
