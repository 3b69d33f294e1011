"""The Gradio demo: standard decoding and MTP decoding side by side (paper arXiv 2602.06019).

``app.ui`` builds the page, ``app.runner`` validates requests and alternates the two strategies'
forward passes, ``app.figures`` draws pass records with Plotly. No model code lives here: the
engine is ``model.*``.
"""

from .ui import build_app, launch

__all__ = ["build_app", "launch"]
