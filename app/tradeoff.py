"""The speed / quality trade-off figure of the loaded checkpoint (paper 4.5): effective k against agreement with
standard decoding and teacher NLL, over the checkpoint's sweep (:class:`model.evaluation.sweep.Sweep`), with the
page's tau and this session's answers (:class:`model.evaluation.sweep.AnswerPoint`) on it. No model code."""

from __future__ import annotations

import html
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from model.evaluation.sweep import AnswerPoint, Sweep, SweepPoint

# ---------------------------------------------------------------------------- the trade-off
TRADEOFF_CONFADAPT = "#d62728"
TRADEOFF_VERIFY = "#2ca02c"
TRADEOFF_STANDARD = "#1f77b4"
TRADEOFF_STATIC = "#9467bd"
TRADEOFF_NOW = "#111111"
ANSWER_IDENTICAL = "#2ca02c"
ANSWER_PARTED = "#ff7f0e"
ANSWER_SAMPLED = "#8c564b"


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
            each at its effective k, 1 (identical) or 0 (parted) on top, its NLL below; a sampled answer below
            only (the sweep's points are greedy, and the title says so).
        source: ``"shipped"`` (the checkpoint's sweep.json) or ``"measured"`` (on this page), for the title.

    Returns:
        A ``go.Figure`` of two panels sharing the x axis; ConfAdapt points labelled with their tau,
        lossless points as diamonds.
    """
    points = sweep.points if sweep is not None else ()
    xs = [p.effective_k for p in points] + [a.effective_k for a in answers]
    panels = _Panels(*((min(xs), max(xs)) if xs else (0.0, 1.0)))
    if sweep is not None:
        _sweep_traces(panels, sweep)
    now = tau_point(sweep, tau, k_max)
    if now is not None and now.get("effective_k") is not None:
        where = "" if now["inside"] else " (outside the measured taus: the nearest end)"
        panels.add([now["effective_k"]], [now["agreement_with_standard"]], [now["nll_teacher"]],
                   name=f"tau {now['tau']:g} now", colour=TRADEOFF_NOW, symbol="star", size=16,
                   hover=[f"the tau slider: {now['tau']:g}{where}<br>effective k ≈ {now['effective_k']:.2f}"])
    _answer_traces(panels, answers)
    fig = panels.fig
    if sweep is None:
        fig.add_annotation(text="No sweep yet: press<br>“Measure the trade-off”", xref="paper", yref="paper", x=0.5,
                           y=0.55, showarrow=False, font={"size": 13})
    fig.update_yaxes(title_text="share", range=[-0.08, 1.2], tickformat=".0%", row=1, col=1)
    fig.update_yaxes(title_text="nats/token", row=2, col=1)
    fig.update_xaxes(title_text="effective k (tokens per pass)", row=2, col=1)
    fig.update_layout(title={"text": _title(sweep, source), "x": 0.0, "xanchor": "left", "font": {"size": 14}},
                      height=670, autosize=True, margin=dict(l=55, r=10, t=120, b=150), hovermode="closest",
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.16, yanchor="top",
                                  font={"size": 11}))
    return fig


class _Panels:
    """The figure's two panels sharing x (agreement on top, NLL below) and how a series is added to both."""

    def __init__(self, x_lo: float, x_hi: float):
        self.x_lo, self.x_hi = x_lo, x_hi
        self.fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                                 subplot_titles=("Identical to standard decoding", "NLL per token under the model"))
        for ann in self.fig.layout.annotations:
            ann.update(x=0.0, xanchor="left", font={"size": 12})

    def side(self, x: float) -> str:
        """Labels right of the middle go left of their point: whole inside the figure on a phone."""
        return "top left" if x > self.x_lo + 0.5 * (self.x_hi - self.x_lo) else "top right"

    def add(self, xs, ys_top, ys_bottom, *, name, colour, symbol, text=None, hover=None, mode="markers", size=10,
            legend=True, dash=None, line=False, open_marker=False) -> None:
        """One series in both panels (one legend entry)."""
        marker = {"color": colour, "symbol": symbol + ("-open" if open_marker else ""), "size": size,
                  "line": {"width": 2 if open_marker else 0, "color": colour}}
        common = {"mode": mode, "marker": marker, "name": name, "legendgroup": name, "hovertext": hover,
                  "hoverinfo": "text" if hover else None}
        if line:
            common["line"] = {"color": colour, "dash": dash or "solid"}
        self.fig.add_trace(go.Scatter(x=xs, y=ys_top, text=text, textposition=[self.side(x) for x in xs],
                                      showlegend=legend, cliponaxis=False, **common), row=1, col=1)  # 100% stays whole
        self.fig.add_trace(go.Scatter(x=xs, y=ys_bottom, showlegend=False, **common), row=2, col=1)


def _hover(p: SweepPoint) -> str:
    nll = p.nll_teacher
    return (f"{html.escape(p.label)}<br>effective k {p.effective_k:.2f}"
            f"<br>identical to standard: {100 * (p.agreement_with_standard or 0):.0f}% of answers"
            f"<br>NLL {'–' if nll is None else f'{nll:.3f}'} nats/token")


def _series(group: Sequence[SweepPoint]) -> tuple[list, list, list]:
    """x (effective k), top (agreement) and bottom (NLL) of a group of sweep points."""
    return ([p.effective_k for p in group], [p.agreement_with_standard for p in group],
            [p.nll_teacher for p in group])


def _sweep_traces(panels: _Panels, sweep: Sweep) -> None:
    """Standard decoding, a ConfAdapt curve per k_max labelled with tau, lossless and static k points."""
    std = sweep.named("standard")
    if std:
        panels.add(*_series(std), name="standard decoding", colour=TRADEOFF_STANDARD, symbol="square",
                   hover=[_hover(p) for p in std])
    ca = sweep.named("confadapt")
    for k in sorted({p.k_max for p in ca}):
        curve = sorted((p for p in ca if p.k_max == k), key=lambda p: -p.tau)
        panels.add(*_series(curve), name=f"ConfAdapt k_max={k} (tau)", colour=TRADEOFF_CONFADAPT,
                   symbol="circle", mode="lines+markers+text", text=_tau_labels(curve, panels.x_hi - panels.x_lo),
                   hover=[_hover(p) for p in curve], line=True, size=8)
    for name, colour, symbol, title in (("verify", TRADEOFF_VERIFY, "diamond", "lossless"),
                                        ("static", TRADEOFF_STATIC, "triangle-up", "static k")):
        group = sweep.named(name)
        if group:
            panels.add(*_series(group), name=title, colour=colour, symbol=symbol, size=12,
                       mode="markers+text" if name == "verify" else "markers",
                       text=[f"k_max {p.k_max}" + ("" if p.linear_verify else f" {p.layout}") for p in group]
                       if name == "verify" else None, hover=[_hover(p) for p in group])


def _answer_traces(panels: _Panels, answers: Sequence[AnswerPoint]) -> None:
    """This session's answers: open circles at 100% (identical) or 0% (parted) on top, their NLL below; sampled
    answers (two draws, never comparable token for token) by their NLL only."""
    sampled = [a for a in answers if a.sampled]
    if sampled:
        hover = [f"turn {a.turn}: {html.escape(a.label)}, sampled<br>effective k {a.effective_k:.2f}"
                 + (f"<br>NLL {a.nll:.3f} (standard's draw {a.standard_nll:.3f})"
                    if a.nll is not None and a.standard_nll is not None else "") for a in sampled]
        panels.add([a.effective_k for a in sampled], [None] * len(sampled), [a.nll for a in sampled],
                   name="your sampled answers (NLL only)", colour=ANSWER_SAMPLED, symbol="x", size=10, hover=hover)
    for ok, colour, title in ((True, ANSWER_IDENTICAL, "your answers: identical"),
                              (False, ANSWER_PARTED, "your answers: diverged")):
        group = [a for a in answers if a.identical == ok and not a.sampled]
        if not group:
            continue
        hover = [f"turn {a.turn}: {html.escape(a.label)}<br>effective k {a.effective_k:.2f}<br>"
                 + ("identical to standard decoding" if ok else f"diverges at token {(a.parted_at or 0) + 1}")
                 + (f"<br>NLL {a.nll:.3f} (standard {a.standard_nll:.3f})"
                    if a.nll is not None and a.standard_nll is not None else "")
                 + ("<br>degenerates into repetition" if a.repeats else "") for a in group]
        panels.add([a.effective_k for a in group], [1.0 if ok else 0.0 for a in group], [a.nll for a in group],
                   name=title, colour=colour, symbol="circle", size=11, open_marker=True, hover=hover)


#: The title's second and third lines: smaller, on the same baseline spacing as the first (``<sup>`` lines were
#: raised, so the gap under the title looked half the gap between them).
_SMALL = '<span style="font-size:10px">'


def _title(sweep: Sweep | None, source: str | None) -> str:
    """The figure's title, then two smaller lines: what the sweep was measured on, and where it comes from (short
    lines: Plotly does not wrap a title, and a phone shows ~60 characters of one)."""
    if sweep is None:
        return f"Speed vs quality<br>{_SMALL}no measured trade-off for this checkpoint yet</span>"
    what = [sweep.model or ""]
    if sweep.n_prompts:
        what.append(f"{sweep.n_prompts} prompts")
    if sweep.max_new_tokens:
        what.append(f"{sweep.max_new_tokens} tokens each")
    how = ["shipped with the checkpoint" if source == "shipped" else "measured on this page"] if source else []
    how.append("greedy decoding")
    lines = [", ".join(b for b in bits if b) for bits in (what, how)]
    return "Speed vs quality" + "".join(f"<br>{_SMALL}{html.escape(line)}</span>" for line in lines if line)

