"""The Gradio demo: standard decoding and an MTP strategy side by side (paper arXiv 2602.06019).

One module per concern, none with a Gradio type but the last four:

* ``app.requests`` — the app's limits, the checks of a request, :class:`~app.requests.TurnRequest`;
* ``app.registry`` — the models loaded; ``app.device`` — what each trades on this device;
* ``app.passes`` — every forward pass of the page, shared between sessions where the kernels allow;
* ``app.turn`` — one turn, both sides, pass by pass; ``app.timing`` and ``app.quality`` — how fast and how
  good each side was; ``app.sessions`` — one turn at a time per session, in order, and what each keeps;
* ``app.zerogpu`` — the GPU on a ZeroGPU Space;
* ``app.render`` (HTML: panes, counters, the coloured answer, tables), ``app.headline`` (the speed in words, the
  status line, the JSON summary), ``app.figures`` (Plotly: the pass animation, the race) and ``app.tradeoff``
  (the trade-off figure) — drawing; ``app.graph`` — those figures as components of the page, drawn by one copy
  of plotly.js; ``app.outputs`` — a turn's states as component updates; ``app.page`` — every event handler, as
  methods; ``app.ui`` — the layout and its wiring.

No model code lives here: the engine is ``model.*``.
"""

from .ui import build_app, launch

__all__ = ["build_app", "launch"]
