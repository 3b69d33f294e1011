"""The page's Plotly figures as Gradio components (:class:`PlotlyGraph`), drawn by one copy of plotly.js.

Gradio writes a ``graph.pyi`` stub beside this module when it defines the component class (it does so for every
component class; the repository ignores it).
"""

from __future__ import annotations

from typing import Any

import gradio as gr
import plotly.graph_objects as go

from . import figures


class PlotlyGraph(gr.HTML):
    """A Plotly figure of the page, drawn by the page's one copy of plotly.js (:data:`app.figures.PLOT_JS`, updated
    with ``Plotly.react``). Its values are ``go.Figure`` objects or the JSON text of :func:`app.figures.figure_json`
    (a caption and the figure, frames kept). Not ``gr.Plot``: that brings its own copy of plotly.js, which the
    browser parses and runs again (~2.5 s of CPU more per page load on a slow core), and drops Plotly frames."""

    def __init__(self, value: Any = None, **kwargs: Any) -> None:
        super().__init__(_as_json(value), html_template=figures.PLOT_TEMPLATE, js_on_load=figures.PLOT_JS,
                         head=figures.PLOT_HEAD, **kwargs)

    def postprocess(self, value: Any) -> str | None:
        """A ``go.Figure`` (or its dict) as :func:`app.figures.figure_json` text; text as it is."""
        return super().postprocess(_as_json(value))


def _as_json(value: Any) -> Any:
    return figures.figure_json(value) if isinstance(value, (go.Figure, dict)) else value
