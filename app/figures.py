"""Plotly figures and page fragments drawn from pass records (no model code here).

* :func:`passes_figure` — the animated figure: one frame per forward pass (paper 3.4, 4.5).
  Top: block width (tokens kept) of every pass so far. Bottom: the current pass's ``k_max``
  proposal confidences, the tau line, the kept tokens highlighted.
* :func:`animated_html` — that figure as a self-contained Plotly page inside an
  ``<iframe srcdoc=...>`` (``gr.Plot`` drops Plotly frames, DESIGN.md section 5). plotly.js is
  not inlined: the page loads it once from :data:`PLOTLY_JS` served as a static file.
* :func:`race_figure` — tokens generated vs seconds for both strategies (the race).
* :func:`coloured_blocks` — the MTP answer as ``gr.HighlightedText`` spans, one per block,
  labelled with its width (the paper's Fig. 1).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Sequence

import plotly
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from model.decoding import PassRecord

#: plotly.js shipped with the plotly package; the app serves it with ``gr.set_static_paths``.
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
#: URL under which Gradio serves :data:`PLOTLY_JS` (absolute path, root-relative URL).
PLOTLY_JS_URL = f"/gradio_api/file={PLOTLY_JS}"

KEPT = "#2ca02c"
REJECTED = "#c7c7c7"
STD_COLOUR = "#1f77b4"
MTP_COLOUR = "#d62728"
BAR_PAST = "#9ecae1"
BAR_NOW = "#08519c"


def _token_label(text: str) -> str:
    """A proposal's text made visible on an axis: spaces as '␣', newlines as '⏎'."""
    shown = text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
    return shown if shown else "∅"


def _width_trace_values(records: Sequence[PassRecord], upto: int) -> tuple[list[int], list[int], list[str]]:
    xs = [r.index + 1 for r in records[: upto + 1]]
    ys = [len(r.kept) for r in records[: upto + 1]]
    colours = [BAR_NOW if i == upto else BAR_PAST for i in range(upto + 1)]
    return xs, ys, colours


def _confidence_values(rec: PassRecord) -> tuple[list[str], list[float], list[str], list[str]]:
    n_kept = len(rec.kept)
    xs = [f"{j + 1}:{_token_label(t)}" for j, t in enumerate(rec.proposal_texts)]
    colours = [KEPT if j < n_kept else REJECTED for j in range(len(rec.confidences))]
    hover = [
        f"block position {j + 1}<br>proposal {t!r}<br>confidence {c:.3f}<br>{'kept' if j < n_kept else 'dropped'}"
        for j, (t, c) in enumerate(zip(rec.proposal_texts, rec.confidences))
    ]
    return xs, list(rec.confidences), colours, hover


def _frame_title(rec: PassRecord, label: str) -> str:
    kept_text = html.escape(repr(rec.text)[1:-1])[:60]
    return (f"{label}: forward pass {rec.index + 1}<br><sub>fed {rec.fed_real} real + {rec.fed_masks} mask tokens, "
            f"kept {len(rec.kept)} in {rec.seconds * 1000:.0f} ms: “{kept_text}”</sub>")


def passes_figure(records: Sequence[PassRecord], *, tau: float | None, k_max: int, label: str = "MTP") -> go.Figure:
    """The animated per-pass figure: one Plotly frame per forward pass.

    Args:
        records: the MTP side's pass records, in order (may be empty).
        tau: the ConfAdapt threshold drawn as a horizontal line (None: no line, e.g. static k).
        k_max: proposals per pass (sets the axes).
        label: strategy label for the title.

    Returns:
        A Plotly figure as a dict (``data``, ``layout``, ``frames``) whose ``frames`` has
        ``len(records)`` entries (named ``"0"``, ``"1"``, ...), with Play / Pause buttons and a
        pass slider; the data shown initially is the last pass. The frames are plain dicts (not
        validated ``go.Frame`` objects): re-rendered on every streamed update, validating them
        would cost ~2.5 ms per frame.
    """
    fig = make_subplots(
        rows=2, cols=1, vertical_spacing=0.2, row_heights=[0.45, 0.55],
        subplot_titles=("Block width per forward pass (tokens kept)",
                        "This pass: proposal confidences (green = kept, grey = dropped)"),
    )
    n = len(records)
    if n == 0:
        fig.add_trace(go.Bar(x=[], y=[], name="block width"), row=1, col=1)
        fig.add_trace(go.Bar(x=[], y=[], name="confidence"), row=2, col=1)
        fig.update_layout(title="Waiting for the first forward pass…", height=520, showlegend=False,
                          margin=dict(l=50, r=20, t=90, b=40))
        out = fig.to_dict()
        out["frames"] = []
        return out

    def traces(i: int) -> list[dict]:
        xs, ys, cs = _width_trace_values(records, i)
        cx, cy, cc, hover = _confidence_values(records[i])
        return [
            {"type": "bar", "x": xs, "y": ys, "marker": {"color": cs}, "name": "block width",
             "hovertemplate": "pass %{x}: %{y} token(s) kept<extra></extra>"},
            {"type": "bar", "x": cx, "y": cy, "marker": {"color": cc}, "name": "confidence", "hovertext": hover,
             "hoverinfo": "text"},
        ]

    last = n - 1
    for t, row in zip(traces(last), (1, 2)):
        fig.add_trace(go.Bar(t), row=row, col=1)
    if tau is not None:
        fig.add_hline(y=tau, line_dash="dash", line_color="#444", row=2, col=1,
                      annotation_text=f"tau = {tau:.2f}", annotation_position="top right")
    fig.update_xaxes(range=[0.5, max(n, 8) + 0.5], title_text="forward pass", row=1, col=1)
    fig.update_yaxes(range=[0, max(k_max, 1) + 0.5], title_text="tokens kept", row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], title_text="top-1 probability", row=2, col=1)
    fig.update_xaxes(title_text="block position: proposal", tickangle=-45, row=2, col=1)
    step_args = {"frame": {"duration": 0, "redraw": True}, "mode": "immediate", "transition": {"duration": 0}}
    fig.update_layout(
        title_text=_frame_title(records[last], label),
        height=640,
        showlegend=False,
        margin=dict(l=55, r=20, t=115, b=150),
        updatemenus=[{
            "type": "buttons", "direction": "left", "x": 0.0, "y": -0.30, "xanchor": "left", "yanchor": "top",
            "pad": {"t": 20}, "showactive": False,
            "buttons": [
                {"label": "▶ Play", "method": "animate",
                 "args": [None, {"frame": {"duration": 350, "redraw": True}, "fromcurrent": True,
                                 "transition": {"duration": 0}, "mode": "immediate"}]},
                {"label": "❚❚ Pause", "method": "animate", "args": [[None], step_args]},
            ],
        }],
        sliders=[{
            "active": last, "x": 0.24, "len": 0.76, "y": -0.30, "yanchor": "top", "pad": {"t": 10},
            "currentvalue": {"prefix": "forward pass ", "visible": True, "font": {"color": "#333"}},
            # beyond ~30 passes the step labels overlap: hide them, the current value still shows
            "font": {"color": "#333" if n <= 30 else "rgba(0,0,0,0)"},
            "steps": [{"label": str(i + 1), "method": "animate", "args": [[str(i)], step_args]} for i in range(n)],
        }],
    )
    out = fig.to_dict()
    out["frames"] = [{"name": str(i), "data": traces(i), "traces": [0, 1],
                      "layout": {"title": {"text": _frame_title(records[i], label)}}} for i in range(n)]
    return out


def animated_html(fig: go.Figure | dict, *, height: int = 660, plotly_js_url: str = PLOTLY_JS_URL) -> str:
    """An ``<iframe srcdoc=...>`` holding ``fig`` as a self-contained Plotly page (frames kept).

    The page loads plotly.js from ``plotly_js_url`` (served once by the app, cached by the
    browser) instead of inlining its ~4.5 MB. The iframe carries ``data-frames`` (the number of
    frames) for tests and scripts.
    """
    frames = fig.get("frames") if isinstance(fig, dict) else fig.frames
    page = pio.to_html(fig, include_plotlyjs=plotly_js_url, full_html=True, div_id="passes-figure", validate=False,
                       config={"displaylogo": False, "responsive": True}, auto_play=False)
    return (f'<iframe class="mtp-passes" data-frames="{len(frames or ())}" title="forward passes" '
            f'style="width:100%;height:{height}px;border:0" srcdoc="{html.escape(page, quote=True)}"></iframe>')


def race_figure(panes: Sequence[tuple[str, Sequence[PassRecord]]]) -> go.Figure:
    """Tokens generated vs seconds for each strategy (the race).

    Args:
        panes: ``(label, records)`` per strategy; seconds are the sum of that strategy's own
            forward-pass times (each pass timed alone, device synchronised).

    Returns:
        A ``go.Figure`` with one step line per strategy.
    """
    fig = go.Figure()
    for (label, records), colour in zip(panes, (STD_COLOUR, MTP_COLOUR, "#ff7f0e")):
        t, n, xs, ys = 0.0, 0, [0.0], [0]
        for r in records:
            t += r.seconds
            n += len(r.kept)
            xs.append(t)
            ys.append(n)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", line_shape="hv", name=label,
                                 line_color=colour, marker_size=4,
                                 hovertemplate="%{y} tokens after %{x:.2f} s<extra>" + label + "</extra>"))
    fig.update_layout(title="The race: tokens generated vs seconds of own forward passes", height=340,
                      xaxis_title="seconds (sum of this strategy's forward passes)", yaxis_title="tokens generated",
                      margin=dict(l=55, r=20, t=50, b=45), legend=dict(x=0.01, y=0.99))
    return fig


def coloured_blocks(records: Sequence[PassRecord]) -> list[tuple[str, str]]:
    """The answer as ``(text, label)`` spans for ``gr.HighlightedText``: one span per forward
    pass that added text, labelled with its block width (tokens kept), as in the paper's Fig. 1.

    The spans' texts concatenate to the answer text.
    """
    return [(r.text, str(len(r.kept))) for r in records if r.text]


def block_colour_map(k_max: int = 32) -> dict[str, str]:
    """Colours for block widths ``"1"`` … ``str(k_max)``: pale for 1, deeper for wider blocks."""
    palette = ["#e8e8e8", "#c6dbef", "#9ecae1", "#6baed6", "#fdd0a2", "#fdae6b", "#fd8d3c", "#e6550d",
               "#fcbba1", "#fb6a4a", "#de2d26", "#a50f15"]
    return {str(k): palette[min(k - 1, len(palette) - 1)] for k in range(1, max(k_max, 1) + 1)}
