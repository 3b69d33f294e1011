"""Plotly figures drawn from pass records (no model code here).

* :func:`passes_figure` — the animated figure: one frame per forward pass of the MTP side (paper
  3.4, 4.5). Top: tokens kept by every pass so far. Bottom, for block strategies: the pass's
  ``k_max`` proposals with their confidence, the first (the model's ordinary next token, always
  kept) marked apart, the kept ones green, the tau line; for lossless verification: the drafts the
  pass checked (accepted green, the rejected one red), the model's own token (its correction or
  its next token) and the new drafts its masks proposed for the next pass.
* :func:`animated_html` — that figure as a self-contained Plotly page inside an
  ``<iframe srcdoc=...>`` (``gr.Plot`` drops Plotly frames, DESIGN.md section 5). plotly.js is
  not inlined: the page loads it once from :data:`PLOTLY_JS` served as a static file.
* :func:`race_figure` — tokens generated vs seconds for both sides (the race).

Token texts on the axes are the engine's own (``PassRecord.proposal_texts``); nothing here decodes.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Sequence

import plotly
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from model.engine.decoding import PassRecord
from model.engine.strategies import Strategy
from model.evaluation.sweep import AnswerPoint, Sweep, SweepPoint

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


def _kept_bars(records: Sequence[PassRecord], upto: int) -> dict:
    xs = [r.index + 1 for r in records[: upto + 1]]
    ys = [len(r.kept) for r in records[: upto + 1]]
    colours = [BAR_NOW if i == upto else BAR_PAST for i in range(upto + 1)]
    return {"type": "bar", "x": xs, "y": ys, "marker": {"color": colours}, "name": "tokens kept",
            "hovertemplate": "pass %{x}: %{y} token(s) kept<extra></extra>"}


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
    (``PassRecord.mask_blocks`` / ``block_texts``): the block that followed the accepted drafts is marked as
    used (its proposals are ``next_drafts``), the others as not used. Height: the model's confidence at that
    place (for a draft, in its own choice there)."""
    rec = records[i]
    texts = rec.draft_texts or [f"id {t}" for t in rec.drafts]
    confs = list(rec.draft_confidences) or [1.0] * len(rec.drafts)
    a, n_kept = rec.drafts_accepted, len(rec.kept)
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
                         f"({html.escape(repr(rec.correction_text))}, confidence {c:.3f}): rejected")
        else:
            colours.append(DRAFT_SKIPPED), labels.append("")
            hover.append(f"draft {j + 1} {html.escape(repr(t))}: after a rejected draft, dropped")
    if n_kept > min(a, len(rec.drafts)):  # the model's own token was kept
        if rec.correction is not None:
            own, c = rec.correction_text, confs[a] if a < len(confs) else 1.0
            what = "the model's correction (its own token where the draft was rejected)"
        else:
            own, c = (rec.proposal_texts[0], rec.confidences[0]) if rec.proposal_texts else ("", 1.0)
            what = "the model's next token" + (" (every draft accepted)" if rec.drafts else " (no drafts to check)")
        xs.append(f"+:{_token_label(own)}")
        ys.append(c)
        colours.append(OWN), labels.append("→")
        hover.append(f"{html.escape(repr(own))} (confidence {c:.3f}): {what}; always kept")
    blocks = list(rec.mask_blocks)
    if not blocks and rec.fed_masks and rec.proposal_texts[1:]:  # a record without block fields: one block
        blocks, block_texts, block_confs = [rec.fed_drafts], [rec.proposal_texts[1:]], [rec.confidences[1:]]
    else:
        block_texts, block_confs = rec.block_texts, rec.block_confidences
    several = len(blocks) > 1
    for b, (after, texts_b, confs_b) in enumerate(zip(blocks, block_texts, block_confs)):
        used = bool(rec.next_drafts) and after == rec.drafts_accepted
        where = f"the block after {after} draft{'s' if after != 1 else ''}"
        if used:
            why = "used: it followed the accepted drafts, so its proposals are the next pass's drafts"
        elif rec.stopped or rec.block_end in ("max_new_tokens", "stop string"):
            why = "not used: the answer ended"
        else:
            why = f"not used: the pass accepted {min(rec.drafts_accepted, len(rec.drafts))} drafts, not {after}"
        for j, (t, c) in enumerate(zip(texts_b, confs_b)):
            xs.append(f"b{after}.m{j + 1}:{_token_label(t)}" if several else f"m{j + 1}:{_token_label(t)}")
            ys.append(c)
            colours.append(NEW_DRAFT if used else UNUSED_BLOCK), labels.append("")
            hover.append(f"{where}, mask {j + 1} proposes {html.escape(repr(t))} (confidence {c:.3f}); {why}")
    patterns = ["/" if c == UNUSED_BLOCK else "" for c in colours]
    return {"type": "bar", "x": xs, "y": ys, "name": "drafts", "text": labels,
            "marker": {"color": colours, "pattern": {"shape": patterns, "fgcolor": "#8e7cc3", "size": 6}},
            "textposition": "inside", "insidetextanchor": "middle", "textfont": {"color": "white", "size": 14},
            "hovertext": hover, "hoverinfo": "text"}


def _frame_title(rec: PassRecord, n: int) -> str:
    """A frame's title: the pass, what it kept and why the block ended, and when the pass carried other sessions'
    rows too, with how many (``shared by 3 sessions, 14 rows``)."""
    k = len(rec.kept)
    shared = f" · shared by {rec.shared_sequences} sessions, {rec.shared_rows} rows" if rec.shared_sequences > 1 else ""
    return f"Pass {rec.index + 1} of {n}: kept {k} ({rec.block_end}){shared}"


def passes_figure(records: Sequence[PassRecord], strategy: Strategy | None) -> dict:
    """The animated per-pass figure: one Plotly frame per forward pass.

    Args:
        records: the MTP side's pass records, in order (may be empty).
        strategy: the MTP strategy (its tau line, its k_max, whether it verifies drafts).

    Returns:
        A Plotly figure as a dict (``data``, ``layout``, ``frames``) whose ``frames`` has
        ``len(records)`` entries (named ``"0"``, ``"1"``, ...), with Play / Pause buttons and a
        pass slider; the data shown initially is the last pass. The frames are plain dicts (not
        validated ``go.Frame`` objects): re-rendered on every streamed update, validating them
        would cost ~2.5 ms per frame.
    """
    verifies = bool(strategy is not None and strategy.verifies)
    k_max = strategy.k_max if strategy is not None else 1
    tau = strategy.tau if strategy is not None and strategy.name == "confadapt" else None
    bottom = "Drafts checked, model's token, new drafts" if verifies else "This pass: proposals, confidence"
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.16, row_heights=[0.42, 0.58],
                        subplot_titles=("Tokens kept per forward pass", bottom))
    for ann in fig.layout.annotations:
        ann.update(x=0.0, xanchor="left", font={"size": 13})
    n = len(records)
    if n == 0:
        fig.add_trace(go.Bar(x=[], y=[]), row=1, col=1)
        fig.add_trace(go.Bar(x=[], y=[]), row=2, col=1)
        fig.update_layout(title={"text": "Waiting for the first forward pass…", "x": 0.0, "xanchor": "left"},
                          height=560, showlegend=False, margin=dict(l=45, r=10, t=60, b=40), autosize=True)
        out = fig.to_dict()
        out["frames"] = []
        return out

    def traces(i: int) -> list[dict]:
        return [_kept_bars(records, i), _verify_bars(records, i) if verifies else _block_bars(records[i])]

    last = n - 1
    for t, row in zip(traces(last), (1, 2)):
        fig.add_trace(go.Bar(t), row=row, col=1)
    if tau is not None:
        fig.add_hline(y=tau, line_dash="dash", line_color="#444", row=2, col=1,
                      annotation_text=f"tau {tau:.2f}", annotation_position="top right")
    fig.update_xaxes(range=[0.5, max(n, 8) + 0.5], row=1, col=1)
    fig.update_yaxes(range=[0, max(k_max, 1) + 0.5], title_text="tokens", row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], title_text="confidence", row=2, col=1)
    # rotated token labels: automargin keeps the first ones inside the figure on a phone (390 px)
    fig.update_xaxes(tickangle=-50, type="category", automargin=True, row=2, col=1)
    step_args = {"frame": {"duration": 0, "redraw": True}, "mode": "immediate", "transition": {"duration": 0}}
    fig.update_layout(
        title={"text": _frame_title(records[last], n), "x": 0.0, "xanchor": "left", "font": {"size": 14}},
        height=600,
        showlegend=False,
        autosize=True,
        margin=dict(l=45, r=10, t=70, b=175),
        updatemenus=[{
            "type": "buttons", "direction": "left", "x": 0.0, "y": -0.24, "xanchor": "left", "yanchor": "top",
            "pad": {"t": 0, "r": 0}, "showactive": False,
            "buttons": [
                {"label": "▶ Play", "method": "animate",
                 "args": [None, {"frame": {"duration": 350, "redraw": True}, "fromcurrent": True,
                                 "transition": {"duration": 0}, "mode": "immediate"}]},
                {"label": "❚❚ Pause", "method": "animate", "args": [[None], step_args]},
            ],
        }],
        sliders=[{
            "active": last, "x": 0.0, "len": 1.0, "y": -0.33, "yanchor": "top", "pad": {"t": 30, "b": 0},
            "currentvalue": {"prefix": "pass ", "visible": True, "xanchor": "right", "font": {"color": "#333"}},
            # beyond ~20 passes the step labels overlap: hide them, the current value still shows
            "font": {"color": "#333" if n <= 20 else "rgba(0,0,0,0)"},
            "steps": [{"label": str(i + 1), "method": "animate", "args": [[str(i)], step_args]} for i in range(n)],
        }],
    )
    out = fig.to_dict()
    out["frames"] = [{"name": str(i), "data": traces(i), "traces": [0, 1],
                      "layout": {"title": {"text": _frame_title(records[i], n)}}} for i in range(n)]
    return out


def animated_html(fig: go.Figure | dict, *, height: int = 620, plotly_js_url: str = PLOTLY_JS_URL) -> str:
    """An ``<iframe srcdoc=...>`` holding ``fig`` as a self-contained Plotly page (frames kept).

    The page loads plotly.js from ``plotly_js_url`` (served once by the app, cached by the
    browser) instead of inlining its ~4.5 MB. The iframe carries ``data-frames`` (the number of
    frames) for tests and scripts.
    """
    frames = fig.get("frames") if isinstance(fig, dict) else fig.frames
    page = pio.to_html(fig, include_plotlyjs=plotly_js_url, full_html=True, div_id="passes-figure", validate=False,
                       config={"displaylogo": False, "responsive": True, "displayModeBar": False},
                       auto_play=False, default_width="100%", default_height=f"{height - 10}px")
    page = page.replace("<head>", "<head><style>html,body{margin:0;padding:0}</style>", 1)
    return (f'<iframe class="mtp-passes" data-frames="{len(frames or ())}" title="forward passes" '
            f'style="width:100%;height:{height}px;border:0" srcdoc="{html.escape(page, quote=True)}"></iframe>')


def race_figure(panes: Sequence[tuple[str, Sequence[PassRecord]]]) -> go.Figure:
    """Tokens generated vs seconds for each side (the race).

    Args:
        panes: ``(label, records)`` per side; seconds are the sum of that side's own forward-pass
            times (each pass timed alone, device synchronised): the plain sums, a different measure from the
            headline's medians (the page's "How speed is measured" says so).

    Returns:
        A ``go.Figure`` with one step line per side; the legend sits above the plot, never over a line.
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
                      margin=dict(l=50, r=10, t=80, b=45), autosize=True,
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=1.02, yanchor="bottom"))
    return fig


# ---------------------------------------------------------------------------- the trade-off
TRADEOFF_CONFADAPT = "#d62728"
TRADEOFF_VERIFY = "#2ca02c"
TRADEOFF_STANDARD = "#1f77b4"
TRADEOFF_STATIC = "#9467bd"
TRADEOFF_NOW = "#111111"
ANSWER_IDENTICAL = "#2ca02c"
ANSWER_PARTED = "#ff7f0e"


def tau_point(sweep: Sweep | None, tau: float | None, k_max: int | None = None) -> dict | None:
    """Where ``tau`` sits on the sweep's ConfAdapt curve: ``{"tau", "k_max", "effective_k",
    "agreement_with_standard", "nll_teacher", "inside"}``, linearly interpolated between the two measured
    taus around it (the curve with the k_max nearest ``k_max``); ``inside`` is False when ``tau`` lies
    outside the measured taus (the nearest end is returned). None without ConfAdapt points or a tau (or
    with a tau that is not a number)."""
    if tau is None or sweep is None:
        return None
    try:
        tau = float(tau)
    except (TypeError, ValueError):
        return None
    points = sweep.named("confadapt")
    if not points or tau != tau:
        return None
    ks = sorted({p.k_max for p in points})
    want = k_max if isinstance(k_max, (int, float)) else ks[-1]
    k = min(ks, key=lambda x: (abs(x - want), -x))
    curve = sorted((p for p in points if p.k_max == k), key=lambda p: p.tau)
    keys = ("effective_k", "agreement_with_standard", "nll_teacher")

    def at(p: SweepPoint) -> dict:
        return {key: getattr(p, key) for key in keys}
    inside = curve[0].tau <= tau <= curve[-1].tau
    if tau <= curve[0].tau:
        vals = at(curve[0])
    elif tau >= curve[-1].tau:
        vals = at(curve[-1])
    else:
        lo = [p for p in curve if p.tau <= tau][-1]
        hi = [p for p in curve if p.tau >= tau][0]
        w = 0.0 if hi.tau == lo.tau else (tau - lo.tau) / (hi.tau - lo.tau)
        vals = {}
        for key in keys:
            a, b = getattr(lo, key), getattr(hi, key)
            vals[key] = None if a is None or b is None else a + w * (b - a)
    return {"tau": tau, "k_max": k, "inside": inside, **vals}


def _tau_labels(curve: Sequence[SweepPoint], x_span: float) -> list[str]:
    """The tau labels of one ConfAdapt curve: points that sit at nearly the same place (within 3% of the x span
    and 5% agreement) share one label, ``0.5, 0.7``, on the first of them, so that no two labels overlap."""
    labels = [""] * len(curve)
    head = None
    for i, p in enumerate(curve):
        near = head is not None and abs(p.effective_k - curve[head].effective_k) <= 0.03 * max(x_span, 1e-9) \
            and abs((p.agreement_with_standard or 0) - (curve[head].agreement_with_standard or 0)) <= 0.05
        if not near:
            head = i
        taus = sorted([float(t) for t in labels[head].split(", ") if t] + [p.tau])
        labels[head] = ", ".join(f"{t:g}" for t in taus)
    return labels


def tradeoff_figure(sweep: Sweep | None, *, tau: float | None = None, k_max: int | None = None,
                    answers: Sequence[AnswerPoint] = (), source: str | None = None) -> go.Figure:
    """The loaded checkpoint's speed/quality trade-off: effective k (x) against agreement with standard
    decoding (top panel: the share of answers identical to standard decoding's) and the answers' mean
    negative log-likelihood per token under the model, adapter off (bottom panel).

    Args:
        sweep: the checkpoint's :class:`~model.evaluation.sweep.Sweep`; None: no sweep yet (the figure says
            how to measure one).
        tau, k_max: the page's current tau (a star on the ConfAdapt curve of the nearest k_max,
            :func:`tau_point`) and k_max box.
        answers: this session's finished answers (:class:`~model.evaluation.sweep.AnswerPoint`): a point
            each at its effective k, 1 (identical) or 0 (parted) on top, its NLL below.
        source: ``"shipped"`` (the checkpoint's sweep.json) or ``"measured"`` (on this page), for the title.

    Returns:
        A ``go.Figure`` of two panels sharing the x axis; ConfAdapt points labelled with their tau,
        lossless points as diamonds.
    """
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=("Identical to standard decoding", "NLL per token under the model"))
    for ann in fig.layout.annotations:
        ann.update(x=0.0, xanchor="left", font={"size": 12})
    points = sweep.points if sweep is not None else ()

    xs_all = [p.effective_k for p in points] + [a.effective_k for a in answers]
    x_lo, x_hi = (min(xs_all), max(xs_all)) if xs_all else (0.0, 1.0)

    def side(x: float) -> str:
        """Labels right of the middle go left of their point: whole inside the figure on a phone."""
        return "top left" if x > x_lo + 0.5 * (x_hi - x_lo) else "top right"

    def add(xs, ys_top, ys_bottom, *, name, colour, symbol, text=None, hover=None, mode="markers", size=10,
            legend=True, dash=None, line=False, open_marker=False):
        marker = {"color": colour, "symbol": symbol + ("-open" if open_marker else ""), "size": size,
                  "line": {"width": 2 if open_marker else 0, "color": colour}}
        common = {"mode": mode, "marker": marker, "name": name, "legendgroup": name, "hovertext": hover,
                  "hoverinfo": "text" if hover else None}
        if line:
            common["line"] = {"color": colour, "dash": dash or "solid"}
        fig.add_trace(go.Scatter(x=xs, y=ys_top, text=text, textposition=[side(x) for x in xs], showlegend=legend,
                                 cliponaxis=False, **common), row=1, col=1)  # labels at 100% stay whole
        fig.add_trace(go.Scatter(x=xs, y=ys_bottom, showlegend=False, **common), row=2, col=1)

    def hover_of(p: SweepPoint) -> str:
        nll = p.nll_teacher
        return (f"{html.escape(p.label)}<br>effective k {p.effective_k:.2f}"
                f"<br>identical to standard: {100 * (p.agreement_with_standard or 0):.0f}% of answers"
                f"<br>NLL {'–' if nll is None else f'{nll:.3f}'} nats/token")

    def series(group: Sequence[SweepPoint]) -> tuple[list, list, list]:
        """x (effective k), top (agreement) and bottom (NLL) of a group of sweep points."""
        return ([p.effective_k for p in group], [p.agreement_with_standard for p in group],
                [p.nll_teacher for p in group])

    std = sweep.named("standard") if sweep is not None else ()
    if std:
        add(*series(std), name="standard decoding", colour=TRADEOFF_STANDARD, symbol="square",
            hover=[hover_of(p) for p in std])
    ca = sweep.named("confadapt") if sweep is not None else ()
    for k in sorted({p.k_max for p in ca}):
        curve = sorted((p for p in ca if p.k_max == k), key=lambda p: -p.tau)
        add(*series(curve), name=f"ConfAdapt k_max={k} (tau)", colour=TRADEOFF_CONFADAPT,
            symbol="circle", mode="lines+markers+text", text=_tau_labels(curve, x_hi - x_lo),
            hover=[hover_of(p) for p in curve], line=True, size=8)
    for name, colour, symbol, title in (("verify", TRADEOFF_VERIFY, "diamond", "lossless"),
                                        ("static", TRADEOFF_STATIC, "triangle-up", "static k")):
        group = sweep.named(name) if sweep is not None else ()
        if group:
            add(*series(group), name=title, colour=colour, symbol=symbol, size=12,
                mode="markers+text" if name == "verify" else "markers",
                text=[f"k_max {p.k_max}" + ("" if p.linear_verify else f" {p.layout}") for p in group]
                if name == "verify" else None, hover=[hover_of(p) for p in group])
    now = tau_point(sweep, tau, k_max)
    if now is not None and now.get("effective_k") is not None:
        where = "" if now["inside"] else " (outside the measured taus: the nearest end)"
        add([now["effective_k"]], [now["agreement_with_standard"]], [now["nll_teacher"]],
            name=f"tau {now['tau']:g} now", colour=TRADEOFF_NOW, symbol="star", size=16,
            hover=[f"the tau slider: {now['tau']:g}{where}<br>effective k ≈ {now['effective_k']:.2f}"])
    for ok, colour, title in ((True, ANSWER_IDENTICAL, "your answers: identical"),
                              (False, ANSWER_PARTED, "your answers: parted")):
        group = [a for a in answers if a.identical == ok]
        if group:
            hover = [f"turn {a.turn}: {html.escape(a.label)}<br>effective k {a.effective_k:.2f}<br>"
                     + ("identical to standard decoding" if ok else f"parts at token {(a.parted_at or 0) + 1}")
                     + (f"<br>NLL {a.nll:.3f} (standard {a.standard_nll:.3f})"
                        if a.nll is not None and a.standard_nll is not None else "")
                     + ("<br>degenerates into repetition" if a.repeats else "") for a in group]
            add([a.effective_k for a in group], [1.0 if ok else 0.0 for a in group],
                [a.nll for a in group], name=title, colour=colour, symbol="circle", size=11,
                open_marker=True, hover=hover)
    if sweep is not None:
        bits = [sweep.model or ""]
        if sweep.n_prompts:
            bits.append(f"{sweep.n_prompts} prompts")
        if sweep.max_new_tokens:
            bits.append(f"{sweep.max_new_tokens} tokens each")
        if source:
            bits.append("shipped with the checkpoint" if source == "shipped" else "measured on this page")
        title = "Speed vs quality<br><sup>" + html.escape(", ".join(b for b in bits if b)) + "</sup>"
    else:
        title = "Speed vs quality<br><sup>no measured trade-off for this checkpoint yet</sup>"
        fig.add_annotation(text="No sweep yet: press<br>“Measure the trade-off”", xref="paper", yref="paper", x=0.5,
                           y=0.55, showarrow=False, font={"size": 13})
    fig.update_yaxes(title_text="share", range=[-0.08, 1.12], tickformat=".0%", row=1, col=1)
    fig.update_yaxes(title_text="nats/token", row=2, col=1)
    fig.update_xaxes(title_text="effective k (tokens per pass)", row=2, col=1)
    fig.update_layout(title={"text": title, "x": 0.0, "xanchor": "left", "font": {"size": 14}}, height=620,
                      autosize=True, margin=dict(l=55, r=10, t=70, b=150), hovermode="closest",
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.16, yanchor="top",
                                  font={"size": 11}))
    return fig
