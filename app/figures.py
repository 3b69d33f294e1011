"""Plotly figures drawn from pass records (no model code here).

* :func:`passes_figure` — the animated figure: one frame per forward pass of the MTP side (paper
  3.4, 4.5). Top: tokens kept by every pass, the frame's pass marked. Bottom, for block strategies: the pass's
  ``k_max`` proposals with their confidence, the first (the model's ordinary next token, always
  kept) marked apart, the kept ones green, the tau line; for lossless verification: the drafts the
  pass checked (accepted green, the rejected one red), the model's own token (its correction or
  its next token) and the new drafts its masks proposed for the next pass.
* :func:`figure_json` — a figure (frames kept) as the JSON text the page's figure components draw
  (:data:`PLOT_JS`): each one Plotly graph in the page, updated with ``Plotly.react`` (``gr.Plot`` drops Plotly
  frames, and brings its own copy of plotly.js: two copies cost the browser ~2.5 s of CPU more per page load on a
  slow core). plotly.js is not inlined: the page loads it once from :data:`PLOTLY_JS`, served as a static file.
* :func:`race_figure` — tokens generated vs seconds for both sides (the race).

The trade-off figure is :mod:`app.tradeoff`.

Token texts on the axes are the engine's own (``PassRecord.proposal_texts``); nothing here decodes.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Sequence

import plotly
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from app.pass_table import BLOCK_END_WORDS
from model.engine.decoding import DraftCheck, PassRecord
from model.engine.strategies import Strategy

#: plotly.js shipped with the plotly package; the app serves it with ``gr.set_static_paths``.
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
#: URL under which Gradio serves :data:`PLOTLY_JS` (absolute path, root-relative URL).
PLOTLY_JS_URL = f"/gradio_api/file={PLOTLY_JS}"

FIRST = "#1b5e20"  # the first proposal: the model's next token, always kept
KEPT = "#43a047"  # a further proposal kept
REJECTED = "#c7c7c7"  # a proposal dropped
CUT = "#a5d6a7"  # accepted, then cut by a stop token or max_new_tokens
DRAFT_OK = "#43a047"  # a draft equal to the model's own choice
DRAFT_BAD = "#d32f2f"  # the first draft that differs (rejected)
DRAFT_SKIPPED = "#e0e0e0"  # drafts after the rejected one (never kept)
OWN = "#ef6c00"  # the model's own token a verify pass adds (correction or next token)
NEW_DRAFT = "#9575cd"  # mask proposals of the block used: the drafts of the next pass
UNUSED_BLOCK = "#d9cff0"  # mask proposals of a block that did not follow the accepted drafts (not used; hatched)
STD_COLOUR = "#1f77b4"
MTP_COLOUR = "#d62728"
BAR_PAST = "#9ecae1"
BAR_NOW = "#08519c"


def _token_label(text: str) -> str:
    """A token's text made visible on an axis: spaces as '␣', newlines as '⏎'; at most 12 characters."""
    shown = text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
    shown = shown if shown else "∅"
    return shown if len(shown) <= 12 else shown[:11] + "…"


def _kept_bars(records: Sequence[PassRecord]) -> dict:
    """Tokens kept by every pass (the top row, the same in every frame)."""
    return {"type": "bar", "x": [r.index + 1 for r in records], "y": [len(r.kept) for r in records],
            "marker": {"color": BAR_PAST}, "name": "tokens kept",
            "hovertemplate": "pass %{x}: %{y} token(s) kept<extra></extra>"}


def _now_bar(rec: PassRecord) -> dict:
    """The pass a frame shows, drawn over its bar in the top row."""
    return {"type": "bar", "x": [rec.index + 1], "y": [len(rec.kept)], "marker": {"color": BAR_NOW},
            "name": "this pass", "hovertemplate": "pass %{x}: %{y} token(s) kept<extra></extra>"}


def _block_bars(rec: PassRecord) -> dict:
    """ConfAdapt / static k: the pass's proposals, height = confidence."""
    n_kept = len(rec.kept)
    xs, colours, hover = [], [], []
    for j, (t, c) in enumerate(zip(rec.proposal_texts, rec.confidences)):
        xs.append(f"{j + 1}:{_token_label(t)}")
        if j == 0:
            colours.append(FIRST)
            what = "the model's next token: always kept, whatever its confidence" if n_kept else "cut"
        elif j < n_kept:
            colours.append(KEPT)
            what = "kept"
        elif j < rec.accepted:
            colours.append(CUT)
            what = f"accepted, then cut ({rec.block_end})"
        else:
            colours.append(REJECTED)
            what = "dropped"
        hover.append(f"block position {j + 1}<br>proposal {html.escape(repr(t))}<br>confidence {c:.3f}<br>{what}")
    return {"type": "bar", "x": xs, "y": list(rec.confidences), "marker": {"color": colours}, "name": "proposals",
            "hovertext": hover, "hoverinfo": "text"}


def _verify_bars(records: Sequence[PassRecord], i: int) -> dict:
    """Lossless verification: the drafts checked (accepted / rejected / dropped after a rejection), the
    model's own token (its correction or its next token), then every mask block's proposals
    (``PassRecord.verification``: ``mask_blocks`` / ``block_texts``): the block that followed the accepted drafts
    is marked as used (its proposals are ``next_drafts``), the others as not used. Height: the model's confidence at
    that place (for a draft, in its own choice there)."""
    rec = records[i]
    check = rec.verification or DraftCheck()  # a record without verification: no drafts, no blocks
    texts = check.draft_texts or [f"id {t}" for t in check.drafts]
    confs = list(check.confidences) or [1.0] * len(check.drafts)
    a, n_kept = check.accepted, len(rec.kept)
    xs, ys, colours, hover, labels = [], [], [], [], []
    for j, (t, c) in enumerate(zip(texts, confs)):
        xs.append(f"d{j + 1}:{_token_label(t)}")
        ys.append(c)
        if j < a and j < n_kept:
            colours.append(DRAFT_OK), labels.append("✓")
            hover.append(f"draft {j + 1} {html.escape(repr(t))}: the model's own choice here "
                         f"(confidence {c:.3f}): accepted")
        elif j < a:
            colours.append(DRAFT_SKIPPED), labels.append("✓")
            hover.append(f"draft {j + 1}: accepted but past the end of the answer ({rec.block_end})")
        elif j == a:
            colours.append(DRAFT_BAD), labels.append("✗")
            hover.append(f"draft {j + 1} {html.escape(repr(t))}: not the model's choice here "
                         f"({html.escape(repr(check.correction_text))}, confidence {c:.3f}): rejected")
        else:
            colours.append(DRAFT_SKIPPED), labels.append("")
            hover.append(f"draft {j + 1} {html.escape(repr(t))}: after a rejected draft, dropped")
    if n_kept > min(a, len(check.drafts)):  # the model's own token was kept
        if check.correction is not None:
            own, c = check.correction_text, confs[a] if a < len(confs) else 1.0
            what = "the model's correction (its own token where the draft was rejected)"
        else:
            own, c = (rec.proposal_texts[0], rec.confidences[0]) if rec.proposal_texts else ("", 1.0)
            what = "the model's next token" + (" (every draft accepted)" if check.drafts else " (no drafts to check)")
        xs.append(f"+:{_token_label(own)}")
        ys.append(c)
        colours.append(OWN), labels.append("→")
        hover.append(f"{html.escape(repr(own))} (confidence {c:.3f}): {what}; always kept")
    blocks = list(check.mask_blocks)
    if not blocks and rec.fed_masks and rec.proposal_texts[1:]:  # a record without block fields: one block
        blocks, block_texts, block_confs = [rec.fed_drafts], [rec.proposal_texts[1:]], [rec.confidences[1:]]
    else:
        block_texts, block_confs = check.block_texts, check.block_confidences
    several = len(blocks) > 1
    for b, (after, texts_b, confs_b) in enumerate(zip(blocks, block_texts, block_confs)):
        used = bool(check.next_drafts) and after == a
        where = f"the block after {after} draft{'s' if after != 1 else ''}"
        if used:
            why = "used: it followed the accepted drafts, so its proposals are the next pass's drafts"
        elif rec.stopped or rec.block_end in ("max_new_tokens", "stop string"):
            why = "not used: the answer ended"
        else:
            why = f"not used: the pass accepted {min(a, len(check.drafts))} drafts, not {after}"
        for j, (t, c) in enumerate(zip(texts_b, confs_b)):
            xs.append(f"b{after}.m{j + 1}:{_token_label(t)}" if several else f"m{j + 1}:{_token_label(t)}")
            ys.append(c)
            colours.append(NEW_DRAFT if used else UNUSED_BLOCK), labels.append("")
            hover.append(f"{where}, mask {j + 1} proposes {html.escape(repr(t))} (confidence {c:.3f}); {why}")
    patterns = ["/" if c == UNUSED_BLOCK else "" for c in colours]
    return {"type": "bar", "x": xs, "y": ys, "name": "drafts", "text": labels,
            "marker": {"color": colours, "pattern": {"shape": patterns, "fgcolor": "#8e7cc3", "bgcolor": UNUSED_BLOCK,
                                                  "size": 6}},
            "textposition": "inside", "insidetextanchor": "middle", "textfont": {"color": "white", "size": 14},
            "hovertext": hover, "hoverinfo": "text"}


def _frame_title(rec: PassRecord, n: int) -> str:
    """A frame's title: the pass and what it kept, then in a smaller second line why the block ended and, when the
    pass carried other sessions' rows too, with how many (``shared by 3 sessions, 14 rows``). Two short lines:
    Plotly does not wrap a title, and one line ran past a phone's figure (``Pass 123 of 123: kept 1 (the next
    proposal was below tau)``)."""
    shared = f" · shared by {rec.shared_sequences} sessions, {rec.shared_rows} rows" if rec.shared_sequences > 1 else ""
    why = BLOCK_END_WORDS.get(rec.block_end, rec.block_end)
    return f"Pass {rec.index + 1} of {n}: kept {len(rec.kept)}<br><sup>{why}{shared}</sup>"


def passes_figure(records: Sequence[PassRecord], strategy: Strategy | None, animate: bool = True) -> dict:
    """The animated per-pass figure: one Plotly frame per forward pass.

    Args:
        records: the MTP side's pass records, in order (may be empty).
        strategy: the MTP strategy (its tau line, its k_max, whether it verifies drafts).
        animate: with frames, Play / Pause and the pass slider (the finished answer's figure). False: the last
            pass only, for an answer still streaming, whose figure is replaced before anyone could play it.

    Returns:
        A Plotly figure as a dict (``data``, ``layout``, ``frames``); animated, its ``frames`` has
        ``len(records)`` entries (named ``"0"``, ``"1"``, ...), with Play / Pause buttons and a
        pass slider, else none. The data shown initially is the last pass. ``data``: every pass's kept
        tokens (trace 0, the same in every frame), the shown pass's bar drawn over it (1) and its
        block (2); a frame sets traces 1 and 2 (its ``data``, in that order) and the title. The
        figure is re-rendered on every streamed update, so its traces and frames are plain dicts
        (validating them grew with the answer: ~2.5 ms a frame).
    """
    verifies = bool(strategy is not None and strategy.lossless)
    k_max = strategy.k_max if strategy is not None else 1
    tau = strategy.tau if strategy is not None and strategy.name == "confadapt" else None
    # tau's value in the title, not on the plot (it sat over the last bar); short enough for a 390 px phone
    bottom = ("Drafts checked, model's token, new drafts" if verifies else "This pass: proposals, confidence"
              if tau is None else f"This pass: proposals (dashed: tau {tau:.2f})")
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.16, row_heights=[0.42, 0.58],
                        subplot_titles=("Tokens kept per forward pass", bottom))
    for ann in fig.layout.annotations:
        ann.update(x=0.0, xanchor="left", font={"size": 13})
    n = len(records)
    fig.update_xaxes(range=[0.5, max(n, 8) + 0.5], row=1, col=1)  # before the first pass too: none below zero
    fig.update_yaxes(range=[0, max(k_max, 1) + 0.5], title_text="tokens", row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], title_text="confidence", row=2, col=1)
    if n == 0:
        fig.add_trace(go.Bar(x=[], y=[]), row=1, col=1)
        fig.add_trace(go.Bar(x=[], y=[]), row=2, col=1)
        fig.update_xaxes(range=[-0.5, max(k_max, 1) - 0.5], showticklabels=False, row=2, col=1)
        fig.update_layout(title={"text": "Waiting for the first forward pass…", "x": 0.0, "xanchor": "left"},
                          height=560, showlegend=False, margin=dict(l=45, r=10, t=60, b=40), autosize=True)
        out = fig.to_dict()
        out["frames"] = []
        return out

    def traces(i: int) -> list[dict]:  # what a frame changes: the top row's bar of pass i, and its block
        return [_now_bar(records[i]), _verify_bars(records, i) if verifies else _block_bars(records[i])]

    last = n - 1
    for row in (1, 1, 2):  # every pass's kept tokens, the pass shown over its bar, that pass's block: plain dicts
        fig.add_trace(go.Bar(), row=row, col=1)  # filled in below (validating them grows with the answer)
    if tau is not None:
        fig.add_hline(y=tau, line_dash="dash", line_color="#444", row=2, col=1)
    # rotated token labels: automargin keeps the first ones inside the figure on a phone (390 px)
    fig.update_xaxes(tickangle=-50, type="category", automargin=True, row=2, col=1)
    fig.update_layout(title={"text": _frame_title(records[last], n), "x": 0.0, "xanchor": "left", "font": {"size": 14}},
                      height=610, showlegend=False, autosize=True, barmode="overlay",
                      margin=dict(l=45, r=10, t=80, b=175))
    out = fig.to_dict()
    for trace, filled in zip(out["data"], [_kept_bars(records)] + traces(last)):
        trace.update(filled)
    out["frames"] = []
    if animate:
        out["layout"]["updatemenus"], out["layout"]["sliders"] = _animation_controls(n)
        # a frame holds only what changes (the pass's bar and block): a turn's frames grow with its passes, not
        # with their square, as when each frame drew every pass's bar up to its own
        out["frames"] = [{"name": str(i), "data": traces(i), "traces": [1, 2],
                          "layout": {"title": {"text": _frame_title(records[i], n)}}} for i in range(n)]
    return out


def _animation_controls(n: int) -> tuple[list[dict], list[dict]]:
    """The pass figure's Play / Pause buttons and its slider over ``n`` frames (the last one shown), as Plotly's
    ``updatemenus`` and ``sliders``."""
    step_args = {"frame": {"duration": 0, "redraw": True}, "mode": "immediate", "transition": {"duration": 0}}
    buttons = [{
        "type": "buttons", "direction": "left", "x": 0.0, "y": -0.24, "xanchor": "left", "yanchor": "top",
        "pad": {"t": 0, "r": 0}, "showactive": False,
        "buttons": [
            {"label": "▶ Play", "method": "animate",
             "args": [None, {"frame": {"duration": 350, "redraw": True}, "fromcurrent": True,
                             "transition": {"duration": 0}, "mode": "immediate"}]},
            {"label": "❚❚ Pause", "method": "animate", "args": [[None], step_args]},
        ],
    }]
    slider = [{
        "active": n - 1, "x": 0.0, "len": 1.0, "y": -0.33, "yanchor": "top", "pad": {"t": 30, "b": 0},
        "currentvalue": {"prefix": "pass ", "visible": True, "xanchor": "right", "font": {"color": "#333"}},
        # beyond ~20 passes the step labels overlap: hide them, the current value still shows
        "font": {"color": "#333" if n <= 20 else "rgba(0,0,0,0)"},
        "steps": [{"label": str(i + 1), "method": "animate", "args": [[str(i)], step_args]} for i in range(n)],
    }]
    return buttons, slider


def figure_json(fig: go.Figure | dict, caption: str = "") -> str:
    """``fig`` (frames kept) and the HTML ``caption`` above it as the value of a figure component of the page.

    Returns:
        JSON text ``{"caption": str, "frames": int, "figure": {"data", "layout", "frames"}}``, which
        :data:`PLOT_JS` draws in the page (and what an API client gets as the ``figure`` output).
    """
    body = pio.to_json(fig, validate=False)
    frames = fig.get("frames") if isinstance(fig, dict) else fig.frames
    return f'{{"caption": {json.dumps(caption)}, "frames": {len(frames or ())}, "figure": {body}}}'


#: The figure components' template: a slot for the caption and the graph's element, the same for every value
#: (Gradio re-renders a template whose text changed, which would wipe the graph Plotly drew in it).
PLOT_TEMPLATE = '<div class="mtp-fig-caption-slot"></div><div class="mtp-plot" data-frames="0"></div>'
#: The figure components' script (Gradio's ``js_on_load``): draws each new value (:func:`figure_json`) into the
#: same graph with ``Plotly.react``, in order, frames included (an animation still playing is stopped first);
#: ``data-frames`` holds the number of frames drawn.
PLOT_JS = """
const slot = element.querySelector('.mtp-fig-caption-slot');
const gd = element.querySelector('.mtp-plot');
const config = {displaylogo: false, responsive: true, displayModeBar: false};
let shown = null, queue = Promise.resolve(), interruptedAt = -1e9;
// Plotly's Play button leaves its animation's promise unhandled: Pause (or a slider step) rejects it with nothing
window.addEventListener('unhandledrejection', (e) => {
  if (e.reason === undefined && performance.now() - interruptedAt < 2000) e.preventDefault();
});
const playing = () => !!(gd._transitionData && gd._transitionData._animationRaf);
const marked = () => {
  gd.removeAllListeners('plotly_animationinterrupted');
  gd.on('plotly_animationinterrupted', () => { interruptedAt = performance.now(); });
};
const draw = () => {
  const text = props.value;
  if (!text || text === shown) return;
  shown = text;
  let v;
  try { v = JSON.parse(text); } catch (e) { console.error('figure: not JSON', e); return; }
  slot.innerHTML = v.caption || '';
  const fig = Object.assign({}, v.figure, {config: config});
  // a new figure while Play runs: purge stops the animation (its frames would land on the new figure's traces)
  queue = queue.then(() => { if (playing()) window.Plotly.purge(gd); return window.Plotly.react(gd, fig); })
    .then(() => { marked(); gd.dataset.frames = String(v.frames); })
    .catch(e => console.error('figure:', e));
};
watch('value', draw);
draw();
"""
#: What the page's head needs for :data:`PLOT_JS`: plotly.js, loaded once (Gradio loads a ``head`` script once).
PLOT_HEAD = f'<script src="{PLOTLY_JS_URL}"></script>'


def race_figure(panes: Sequence[tuple[str, Sequence[PassRecord]]]) -> go.Figure:
    """Tokens generated vs seconds for each side (the race).

    Args:
        panes: ``(label, records)`` per side; seconds are the sum of that side's own forward-pass
            times (each pass timed alone, device synchronised): the plain sums, a different measure from the
            headline's medians (the page's "How speed is measured" says so).

    Returns:
        A ``go.Figure`` with one step line per side; the legend sits under the axis title, never over a line or
        the title (above the plot, a lossless label wrapped onto two lines on a phone and reached the title).
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
                                 hovertemplate="%{y} tokens after %{x:.2f} s<extra>" + html.escape(label) + "</extra>"))
    fig.update_layout(title={"text": "Race: tokens vs measured seconds", "x": 0.0, "xanchor": "left"}, height=360,
                      xaxis_title="measured s (sum of own passes)", yaxis_title="tokens",
                      xaxis_rangemode="nonnegative", yaxis_rangemode="nonnegative",
                      margin=dict(l=50, r=10, t=50, b=45), autosize=True,
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.26, yanchor="top"))
    return fig
