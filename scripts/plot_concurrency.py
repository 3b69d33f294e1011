"""Plot the MTP / standard ratio against concurrency from a ``python -m model.bench --concurrency ... --json``
report, beside the two points the authors published for their SGLang fork (ConfAdapt tau 0.9).

    .venv/bin/python scripts/plot_concurrency.py docs/concurrency.json --out docs/concurrency.png [--markdown]

One line per (strategy, arrival mode) for the strategies in ``--strategies`` (default ConfAdapt tau 0.9 / k_max 4,
verify k_max 4 as a full tree, and verify:auto, whose width follows the load); the published points are markers only (2.31x at 1 request, 0.26x at 16:
nothing in between was published, so nothing is drawn in between). PNG export needs plotly + kaleido with
Chrome/Chromium (``BROWSER_PATH``, default /usr/bin/chromium when it exists); ``.svg`` or ``.pdf`` outputs use
the same exporter. ``--cpu`` plots the ratios of rates over the bench's CPU seconds instead of wall-clock
seconds (what to plot when other jobs loaded the machine: they leave out the waits for a core).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

#: The authors' published SGLang figures for ConfAdapt tau 0.9: (concurrent requests, x standard).
PUBLISHED_SGLANG = ((1, 2.31), (16, 0.26))
PUBLISHED_LABEL = "authors' SGLang fork (published)"
CHROMIUM = "/usr/bin/chromium"
NAMES = {"confadapt:0.9:4": "ConfAdapt tau 0.9, k_max 4", "verify:4:full": "verify k_max 4, full tree",
         "verify:4:auto": "verify:auto, k_max ≤ 4 (width by load)"}
SHORT = {"confadapt:0.9:4": "ConfAdapt 0.9 / k_max 4", "verify:4:full": "verify k_max 4 full tree",
         "verify:4:auto": "verify:auto k_max ≤ 4"}
COLORS = {"confadapt:0.9:4": "#1f77b4", "verify:4:full": "#2ca02c", "verify:4:auto": "#d62728"}
DASH = {"together": "solid", "staggered": "dash"}


def ratio_series(report: dict, strategy: str, arrival: str, cpu: bool = False) -> tuple[list[int], list[float]]:
    """The (concurrency levels, MTP / standard ratios) of one strategy and arrival mode in ``report``, by level
    (``cpu``: the ratios of rates over CPU seconds, ``ratio_to_standard_cpu``)."""
    key = "ratio_to_standard_cpu" if cpu else "ratio_to_standard"
    pts = sorted((r["concurrency"], r[key]) for r in report["concurrency"]
                 if r["strategy"] == strategy and r.get("arrival", "together") == arrival and r.get(key) is not None)
    return [n for n, _ in pts], [x for _, x in pts]


def concurrency_figure(report: dict, strategies: list[str], cpu: bool = False):
    """The plotly figure: measured ratio lines per strategy and arrival mode (``cpu``: rates over CPU seconds),
    the published SGLang markers and a dotted line at 1 (standard decoding at the same concurrency)."""
    import plotly.graph_objects as go

    cfg = report.get("config", {})
    fig = go.Figure()
    arrivals = list(dict.fromkeys(r.get("arrival", "together") for r in report["concurrency"]))
    for s in strategies:
        for a in arrivals:
            x, y = ratio_series(report, s, a, cpu)
            if not x:
                continue
            fig.add_trace(go.Scatter(
                x=x, y=y, mode="lines+markers", name=f"{NAMES.get(s, s)}, arriving {a} (ours, CPU)",
                line={"color": COLORS.get(s), "dash": DASH.get(a, "dot"), "width": 2}, marker={"size": 7},
                hovertemplate="%{x} requests: %{y:.2f}x standard<extra></extra>"))
    fig.add_trace(go.Scatter(
        x=[n for n, _ in PUBLISHED_SGLANG], y=[r for _, r in PUBLISHED_SGLANG], mode="markers+text",
        name=f"{PUBLISHED_LABEL}: ConfAdapt tau 0.9", text=[f"{r:.2f}x" for _, r in PUBLISHED_SGLANG],
        textposition=["middle right", "bottom center"],
        marker={"symbol": "diamond", "size": 12, "color": "#d62728"}))
    levels = sorted({r["concurrency"] for r in report["concurrency"]} | {n for n, _ in PUBLISHED_SGLANG})
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "gray"}, annotation_text="standard decoding",
                  annotation_position="top right")
    threads = cfg.get("threads")
    parts = [cfg.get("dtype"), threads and f"{threads} thread" + ("s" if threads > 1 else ""),
             cfg.get("prompts") and f"{cfg['prompts']} prompts x {cfg['max_new_tokens']} tokens"]
    where = ", ".join(str(x) for x in parts if x)
    fig.update_layout(
        title={"text": "MTP / standard decoding, aggregate tokens per "
                       + ("CPU second" if cpu else "second") + ", by concurrent requests"
                       + (f"<br><sup>ours: SmolLM2-135M + MTP adapter on our CPU kernels ({where}); "
                          f"every request identical to its solo run: "
                          f"{'yes' if report.get('all_identical_to_solo') else 'NO'}</sup>" if where else "")},
        xaxis={"title": "concurrent requests", "type": "log", "tickvals": levels, "ticktext": [str(n) for n in levels]},
        yaxis={"title": "x standard decoding at the same concurrency" + (" (over CPU seconds)" if cpu else ""),
               "rangemode": "tozero"},
        legend={"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0}, template="plotly_white",
        width=900, height=600, margin={"b": 150})
    return fig


def markdown_table(report: dict, strategies: list[str]) -> str:
    """The README's table: per level and arrival mode, standard's aggregate tok/s (median per request), each
    strategy's aggregate tok/s with its ratio to standard (wall-clock; over CPU seconds), mean rows per pass and
    whether every request equalled its solo run."""
    rows = report["concurrency"]
    by = {(r["concurrency"], r.get("arrival", "together"), r["strategy"]): r for r in rows}
    head = (["requests at once", "arrival", "standard: tok/s; tok per CPU s (median per request, tok/s)"]
            + [f"{SHORT.get(s, s)}: tok/s (x standard; same over CPU s)" for s in strategies]
            + ["rows per pass (standard / " + " / ".join(SHORT.get(s, s).split(" ")[0] for s in strategies) + ")",
               "identical to solo"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, a in dict.fromkeys((r["concurrency"], r.get("arrival", "together")) for r in rows):
        std = by.get((n, a, "standard"))
        cpu_rate = std and std.get("aggregate_tokens_per_cpu_second")
        cells = [str(n), a, f"{std['aggregate_tokens_per_second']:.1f}" + (f"; {cpu_rate:.1f}" if cpu_rate else "")
                 + f" ({std['median_request_tokens_per_second']:.1f})" if std else ""]
        for s in strategies:
            r = by.get((n, a, s))
            if r is None or r.get("ratio_to_standard") is None:
                cells.append("")
                continue
            cpu = r.get("ratio_to_standard_cpu")
            cells.append(f"{r['aggregate_tokens_per_second']:.1f} ({r['ratio_to_standard']:.2f}"
                         + (f"; {cpu:.2f})" if cpu is not None else ")"))
        group = [by[(n, a, s)] for s in ["standard"] + strategies if (n, a, s) in by]
        cells.append(" / ".join(f"{r['rows_per_pass']:.1f}" for r in group))
        cells.append("all" if all(all(r["identical_to_solo"]) for r in group) else
                     f"{sum(sum(r['identical_to_solo']) for r in group)}/{sum(len(r['identical_to_solo']) for r in group)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: read the report, write the image; returns the exit status (0 ok, 1 export failed)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", nargs="?", default="docs/concurrency.json", help="model.bench --concurrency JSON")
    p.add_argument("--out", default="docs/concurrency.png", help="image file (.png, .svg or .pdf)")
    p.add_argument("--strategies", default="confadapt:0.9:4,verify:4:full,verify:4:auto")
    p.add_argument("--markdown", action="store_true", help="also print the README's table (markdown)")
    p.add_argument("--cpu", action="store_true",
                   help="plot the ratios of rates over CPU seconds (ratio_to_standard_cpu; a loaded machine)")
    args = p.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.markdown:
        print(markdown_table(report, strategies))
    fig = concurrency_figure(report, strategies, cpu=args.cpu)
    if "BROWSER_PATH" not in os.environ and Path(CHROMIUM).exists():
        os.environ["BROWSER_PATH"] = CHROMIUM
    try:
        fig.write_image(args.out, scale=2)
    except Exception as e:  # kaleido missing, no browser: say so in one line
        print(f"error: image export failed ({type(e).__name__}: {e}); plotly + kaleido and Chrome/Chromium "
              f"are needed", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
