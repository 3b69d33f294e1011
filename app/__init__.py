"""The Gradio demo: standard decoding and an MTP strategy side by side (paper arXiv 2602.06019).

``app.runner`` prepares and runs a turn (validation through the engine's vocabulary, the app's
limits, the model, the prompt; passes alternating, Stop / Clear, one run per session, a load-robust
speed estimate) with no Gradio types; ``app.render`` draws HTML and ``app.figures`` Plotly figures
from its records; ``app.ui`` lays out the page and wires the events. No model code lives here: the
engine is ``model.*``.
"""

from .ui import build_app, launch

__all__ = ["build_app", "launch"]
