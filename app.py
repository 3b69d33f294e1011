"""Entry point (also the Hugging Face Spaces ``app_file``): ``python app.py`` serves the demo.

Environment: ``GRADIO_SERVER_NAME`` (default 127.0.0.1; Spaces sets 0.0.0.0),
``GRADIO_SERVER_PORT`` (default 7860), ``MTP_APP_*`` limits (see ``app/runner.py``).
"""

from __future__ import annotations

import logging
import os

from app import build_app, launch

demo = build_app()

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launch(demo, server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
           server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
