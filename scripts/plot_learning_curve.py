"""Plot a training run's learning curve: held-out agreement at mask positions (``python -m model.heldout`` over the
run's exports, one JSON per domain) against the sequences trained on, beside the training log's own agreement.

    .venv/bin/python scripts/plot_learning_curve.py --train-log runs/v5/train_log.jsonl \\
        --heldout general=runs/v5/curve_general.json gsm8k=runs/v5/curve_gsm8k.json \\
        --start assets/smollm2-135m-mtp --out assets/smollm2-135m-mtp/learning_curve.png

Each exported model directory (``model.train --export-every``) holds ``trained.json`` (step, sequences seen,
training CPU seconds): that is its x. ``--start`` names the model the run continued from (x = 0). PNG export needs
plotly + kaleido with Chrome/Chromium (``BROWSER_PATH``, default /usr/bin/chromium when it exists).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"]


def curve(heldout: dict, start: str | None) -> list[tuple[int, float, float]]:
    """``(sequences seen, agreement, its standard error)`` per model of a ``model.heldout`` report, by x."""
    pts = []
    for name, res in heldout["models"].items():
        a = res.get("agreement_set") or {}
        if "agreement" not in a:
            continue
        info = Path(name) / "trained.json"
        if info.is_file():
            seen = json.loads(info.read_text())["seen"]
        elif start is not None and Path(name).resolve() == Path(start).resolve():
            seen = 0
        else:
            continue
        pts.append((seen, a["agreement"], a.get("agreement_se_cluster", 0.0)))
    return sorted(pts)


def log_curve(path: Path, window: int = 100) -> tuple[list[int], list[float]]:
    """The training log's agreement at mask positions, a running mean over ``window`` steps, by sequences seen
    (of this run; resumed segments continue it)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "agreement_mask" in r and "seen" in r]
    xs, ys, acc = [], [], []
    for r in rows:
        acc.append(r["agreement_mask"])
        acc = acc[-window:]
        xs.append(r["seen"])
        ys.append(sum(acc) / len(acc))
    return xs, ys


def figure(curves: dict[str, list[tuple[int, float, float]]], log: tuple[list[int], list[float]] | None):
    """The plotly figure."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for (name, pts), color in zip(curves.items(), COLORS):
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                 name=f"held-out, {name}", line={"color": color},
                                 error_y={"type": "data", "array": [p[2] for p in pts], "visible": True}))
    if log is not None and log[0]:
        fig.add_trace(go.Scatter(x=log[0], y=log[1], mode="lines", name="training batches (running mean of 100 steps)",
                                 line={"color": "#7f7f7f", "dash": "dot"}))
    fig.update_layout(title="Teacher agreement at mask positions while training", width=900, height=520,
                      xaxis_title="sequences trained on (this run)", yaxis_title="agreement (share of mask positions)",
                      legend={"orientation": "h", "y": -0.2}, margin={"l": 60, "r": 20, "t": 60, "b": 110})
    return fig


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input or a failed export)."""
    p = argparse.ArgumentParser(prog="scripts/plot_learning_curve.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--heldout", nargs="+", required=True, metavar="NAME=REPORT.json")
    p.add_argument("--train-log", default=None, help="the run's train_log.jsonl")
    p.add_argument("--start", default=None, help="the model the run continued from (x = 0)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        curves = {}
        for spec in args.heldout:
            name, _, path = spec.partition("=")
            curves[name] = curve(json.loads(Path(path).read_text()), args.start)
        log = log_curve(Path(args.train_log)) if args.train_log else None
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.path.exists("/usr/bin/chromium"):
        os.environ.setdefault("BROWSER_PATH", "/usr/bin/chromium")
    try:
        figure(curves, log).write_image(args.out, scale=2)
    except Exception as e:  # kaleido missing, no browser: say so in one line
        print(f"error: image export failed ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    for name, pts in curves.items():
        print(name, " ".join(f"{seen}:{a:.3f}" for seen, a, _ in pts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
