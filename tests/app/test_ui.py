"""The page (app/ui.py): the figure caption, and the page's API — ``python app.py`` served on loopback
(the real default model; integration) or the app with tiny models served in-process — driven with
gradio_client."""

from __future__ import annotations

import html as htmllib
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from app import figures, render, ui
from model.engine.decoding import generate
from model.engine.strategies import confadapt, standard
from tests.app.conftest import N_NEW, PROMPT, free_port
from tests.conftest import ROOT


# ---------------------------------------------------------- the figure caption
def test_figure_caption_names_every_colour_the_figure_uses():
    """Each colour a ConfAdapt / static k frame can draw has a swatch in the caption above the figure."""
    caption = ui.figure_caption("ConfAdapt")
    for colour in (figures.FIRST, figures.KEPT, figures.CUT, figures.REJECTED):
        assert f"background:{colour}" in caption, colour


# -------------------------------------------------------------- the page's API
@pytest.fixture(scope="module")
def served(tmp_path_factory, lm):
    """``python app.py`` (the real entry point) serving on loopback for this module: (process, url)."""
    port = free_port()
    log = tmp_path_factory.mktemp("app") / "app.log"
    env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), HF_HUB_OFFLINE="1",
               GRADIO_ANALYTICS_ENABLED="False")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"python app.py did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.3)
        yield proc, url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(served):
    from gradio_client import Client

    return Client(served[1], verbose=False)


def ask(client, message, history=(), strategy="ConfAdapt", tau=0.9, k_max=4, k=3, max_new_tokens=N_NEW):
    """One /chat call; returns the outputs as a dict keyed by :data:`app.ui.TURN_OUTPUTS`."""
    from app.ui import TURN_OUTPUTS

    out = client.predict(message, list(history), strategy, tau, k_max, k, max_new_tokens, api_name="/chat")
    return dict(zip(TURN_OUTPUTS, out))


@pytest.mark.integration
def test_api_answers_like_the_engine(client, lm):
    out = ask(client, PROMPT)
    res = out["result"]
    std_ref, mtp_ref = generate(lm, PROMPT, standard(), N_NEW), generate(lm, PROMPT, confadapt(0.9, 4), N_NEW)
    assert res["phase"] == "done" and res["turn"] == 1 and re.match(r"Turn 1: done in [0-9.]+ s", res["status"])
    assert res["standard"]["text"] == std_ref.text and res["mtp"]["text"] == mtp_ref.text
    assert res["standard"]["new_tokens"] == std_ref.new_tokens
    assert res["mtp"]["forward_passes"] == mtp_ref.forward_passes and res["mtp"]["strategy"] == "confadapt:0.9:4"
    assert res["mtp"]["kept_per_pass"] == [len(p.kept) for p in mtp_ref.passes]
    assert res["speed"]["text"] == render.times_text(res["speed"]["ratio"])
    assert out["history"][-1] == {"role": "assistant", "content": std_ref.text,
                                                           "mtp": mtp_ref.text}
    assert f'data-frames="{mtp_ref.forward_passes}"' in out["figure"] and "plotly.min.js" in out["figure"]
    assert htmllib.escape(std_ref.text, quote=True) in out["chat_std"]


@pytest.mark.integration
def test_api_takes_a_plain_string_history_and_answers_the_same_conversation(client, lm):
    """Issues 3 and 9: plain-string history over the API; both sides answer the same conversation."""
    history = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    out = ask(client, "Name another one.", history, strategy="lossless", max_new_tokens=8)
    conversation = history + [{"role": "user", "content": "Name another one."}]
    ref = generate(lm, conversation, standard(), 8).text
    res = out["result"]
    assert res["phase"] == "done" and res["turn"] == 2
    assert res["standard"]["text"] == ref and res["mtp"]["text"] == ref and res["identical"]
    assert res["mtp"]["strategy"] == "verify:4"
    assert len(out["history"]) == 4


@pytest.mark.integration
@pytest.mark.parametrize(
    ("tau", "k_max", "max_new", "expected"),
    [(-1, 4, 8, "tau must be in [0, 1], got -1"), (0.9, 33, 8, "k_max must be from 1 to 32, got 33"),
     (0.9, 4, 100_000, "max_new_tokens must be from 1 to 1024, got 100000")],
)
def test_api_refuses_out_of_range_values_instead_of_clamping(client, tau, k_max, max_new, expected):
    out = ask(client, "hi", tau=tau, k_max=k_max, max_new_tokens=max_new)
    assert out["result"]["phase"] == "error" and out["result"]["status"].endswith(expected + ".")
    assert "Error" in out["status"] and expected in out["status"]


@pytest.mark.integration
def test_api_load_model_errors_keep_the_current_model(client):
    info, status, _ = client.predict("smollm2-135m", "/nonexistent/model-dir", "none", "auto", api_name="/load_model")
    assert "No such local model" in status and "Still using smollm2-135m." in status
    info, status, _ = client.predict("smollm2-135m", "", "4bit", "auto", api_name="/load_model")
    assert "needs a CUDA GPU" in status and "Still using smollm2-135m." in status
    # a file that exists but is not a model
    info, status, _ = client.predict("smollm2-135m", str(ROOT / "README.md"), "none", "auto", api_name="/load_model")
    assert f"{ROOT / 'README.md'} is a file, not a model: give a model directory" in status
    assert "Still using smollm2-135m." in status and "Traceback" not in status
    out = ask(client, PROMPT, max_new_tokens=4)
    assert out["result"]["phase"] == "done"


def test_api_engine_errors_are_messages_and_the_worker_lives(tiny_registry):
    """NonFiniteLogitsError and the context budget through the page's API, served in-process."""
    from gradio_client import Client

    from app import build_app, launch

    demo = build_app(tiny_registry, preload=False)
    _, url, _ = launch(demo, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        c = Client(url, verbose=False)
        out = ask(c, "hi", max_new_tokens=8)  # every source is a tiny model here: fine
        assert out["result"]["phase"] == "done"
        out = ask(c, "hi " * 1990, max_new_tokens=200)
        assert out["result"]["phase"] == "error" and "max_position_embeddings" in out["status"]
        info, status, _ = c.predict("smollm2-135m", "nan", "none", "auto", api_name="/load_model")  # weights with NaN
        assert "Loaded nan" in status
        out = ask(c, "hi", max_new_tokens=8)
        assert out["result"]["phase"] == "error" and "NaN or infinite logits" in out["status"]
        assert "Traceback" not in out["status"]
        c.predict("smollm2-135m", "tiny", "none", "auto", api_name="/load_model")
        assert ask(c, "hi", max_new_tokens=4)["result"]["phase"] == "done"  # the worker still serves
    finally:
        demo.close()
