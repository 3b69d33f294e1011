"""The Gradio app through its API (gradio_client), on the real default model (SmolLM2 GGUF).

``python app.py`` is started as a subprocess on 127.0.0.1 (the real entry point); its answers
are compared with the engine's own ``model.decoding.generate`` on the same default model,
loaded here the same way the app loads it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from model.decoding import confadapt, generate, standard, static_k

pytestmark = pytest.mark.integration

N_NEW = 12
PROMPT = "What is 7 times 8? Answer with the number."


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(process, url, default model): ``python app.py`` serving on loopback for this module."""
    from model.checkpoint import load_checkpoint

    port = free_port()
    log = tmp_path_factory.mktemp("app") / "app.log"
    env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), HF_HUB_OFFLINE="1",
               GRADIO_ANALYTICS_ENABLED="False")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        lm = load_checkpoint("smollm2-135m")  # what the app loads by default (while it starts)
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"python app.py did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.3)
        yield proc, url, lm
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(served):
    from gradio_client import Client

    return Client(served[1], verbose=False)


def ask(client, message, history_std=(), history_mtp=(), strategy="ConfAdapt", tau=0.9, k_max=16, k=3,
        max_new_tokens=N_NEW):
    """One /chat call; returns the outputs as a dict keyed by component."""
    out = client.predict(message, list(history_std), list(history_mtp), strategy, tau, k_max, k, max_new_tokens,
                         api_name="/chat")
    keys = ["message", "chat_std", "chat_mtp", "stats_std", "stats_mtp", "speedup", "coloured", "figure", "race",
            "table", "status"]
    return dict(zip(keys, out))


def answer_text(chat) -> str:
    """Text of the last assistant message of a Chatbot value (Gradio 6 content parts)."""
    last = chat[-1]
    assert last["role"] == "assistant"
    content = last["content"]
    return content if isinstance(content, str) else "".join(c.get("text", "") for c in content)


def counters(stats_md: str) -> dict[str, float]:
    """Parse the stats table under a pane."""
    head, _, row = [ln for ln in stats_md.splitlines() if ln.startswith("|")][:3]
    names = [c.strip() for c in head.strip("|").split("|")]
    values = [float(c) for c in row.strip("|").split("|")]
    return dict(zip(names, values))


def test_answers_one_prompt_like_the_engine(served, client):
    _, _, lm = served
    out = ask(client, PROMPT)
    std_ref = generate(lm, PROMPT, standard(), N_NEW)
    mtp_ref = generate(lm, PROMPT, confadapt(0.9, 16), N_NEW)
    assert re.match(r"Turn 1: done in [0-9.]+ s", out["status"]), out["status"]
    assert answer_text(out["chat_std"]) == std_ref.text and std_ref.text.strip()
    assert answer_text(out["chat_mtp"]) == mtp_ref.text
    s, m = counters(out["stats_std"]), counters(out["stats_mtp"])
    assert s["tokens"] == std_ref.new_tokens and s["forward passes"] == std_ref.forward_passes
    assert s["effective k"] == 1.0 and s["tokens/s"] > 0 and s["total s"] > 0
    assert m["tokens"] == mtp_ref.new_tokens and m["forward passes"] == mtp_ref.forward_passes
    assert m["effective k"] == pytest.approx(mtp_ref.effective_k, abs=0.005)
    # the coloured answer is the MTP answer, one span per pass that added text
    assert "".join(t["token"] for t in out["coloured"]) == mtp_ref.text
    widths = [len(p.kept) for p in mtp_ref.passes if p.text]
    assert [int(t["class_or_confidence"]) for t in out["coloured"]] == widths
    # the animated figure holds one frame per forward pass of the MTP side
    assert f'data-frames="{mtp_ref.forward_passes}"' in out["figure"]
    assert "/gradio_api/file=" in out["figure"] and "plotly.min.js" in out["figure"]
    assert re.search(r"Wall-clock speedup of ConfAdapt tau=0\.90 k_max=16 over standard: [0-9.]+×", out["speedup"])
    # answers of different length are compared in tokens/s, never by the time ratio
    assert ("in tokens/s" in out["speedup"]) == (std_ref.new_tokens != mtp_ref.new_tokens)
    rows = out["table"]["data"]
    assert len(rows) == std_ref.forward_passes + mtp_ref.forward_passes
    assert all(r[5] > 0 for r in rows)  # per-pass milliseconds


def test_static_k_and_second_turn_use_the_history(served, client):
    _, _, lm = served
    first = ask(client, "Name a colour.", strategy="static k", k_max=4, k=2, max_new_tokens=8)
    assert first["status"].startswith("Turn 1: done in"), first["status"]
    second = ask(client, "Name another one.", first["chat_std"], first["chat_mtp"], strategy="static k", k_max=4,
                 k=2, max_new_tokens=8)
    assert second["status"].startswith("Turn 2: done in"), second["status"]
    hist_std = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": answer_text(first["chat_std"])},
                {"role": "user", "content": "Name another one."}]
    hist_mtp = hist_std[:1] + [{"role": "assistant", "content": answer_text(first["chat_mtp"])}] + hist_std[2:]
    assert answer_text(second["chat_std"]) == generate(lm, hist_std, standard(), 8).text
    ref = generate(lm, hist_mtp, static_k(2, 4), 8)
    assert answer_text(second["chat_mtp"]) == ref.text
    assert len(second["chat_std"]) == 4 and len(second["chat_mtp"]) == 4
    # static k=2: two tokens every pass, except a last pass cut at the stop token
    assert [len(p.kept) for p in ref.passes[:-1]] == [2] * (ref.forward_passes - 1)
    assert counters(second["stats_mtp"])["effective k"] == pytest.approx(ref.effective_k, abs=0.005)


@pytest.mark.parametrize(
    ("message", "tau", "k_max", "k", "strategy", "max_new", "expected"),
    [
        ("", 0.9, 16, 3, "ConfAdapt", N_NEW, "The message is empty"),
        ("   \n ", 0.9, 16, 3, "ConfAdapt", N_NEW, "The message is empty"),
        ("hi", 1.5, 16, 3, "ConfAdapt", N_NEW, "tau must be in [0, 1], got 1.5"),
        ("hi", -0.1, 16, 3, "ConfAdapt", N_NEW, "tau must be in [0, 1], got -0.1"),
        ("hi", 0.9, 0, 3, "ConfAdapt", N_NEW, "k_max must be between 1 and 32, got 0"),
        ("hi", 0.9, 999, 3, "ConfAdapt", N_NEW, "k_max must be between 1 and 32, got 999"),
        ("hi", 0.9, 2.5, 3, "ConfAdapt", N_NEW, "k_max must be a whole number"),
        ("hi", 0.9, 4, 5, "static k", N_NEW, "k (5) cannot exceed k_max (4)"),
        ("hi", 0.9, 16, 3, "ConfAdapt", 0, "max new tokens must be at least 1, got 0"),
        ("hi", 0.9, 16, 3, "ConfAdapt", -3, "max new tokens must be at least 1, got -3"),
        ("x" * 20_000, 0.9, 16, 3, "ConfAdapt", N_NEW, "The message is 20,000 characters long"),
        ("hello " * 2_500, 0.9, 16, 3, "ConfAdapt", N_NEW, "this demo prefills at most 2,048 tokens"),
    ],
)
def test_bad_input_gives_a_clear_message(client, message, tau, k_max, k, strategy, max_new, expected):
    out = ask(client, message, strategy=strategy, tau=tau, k_max=k_max, k=k, max_new_tokens=max_new)
    assert out["status"].startswith("⚠️ **Error:**"), out["status"]
    assert expected in out["status"]
    assert "Traceback" not in out["status"]


@pytest.mark.parametrize(
    ("choice", "path", "quant", "expected"),
    [
        ("smollm2-135m", "/nonexistent/model-dir", "none", "No such local model: /nonexistent/model-dir"),
        ("smollm2-135m", "not a source!", "none", "Unknown model source 'not a source!'"),
        ("smollm2-135m", "", "4bit", "needs a CUDA GPU"),
    ],
)
def test_bad_model_source_keeps_the_current_model(client, choice, path, quant, expected):
    info, status = client.predict(choice, path, quant, api_name="/load_model")
    assert expected in status and "Still using smollm2-135m." in status


def test_app_keeps_serving_after_errors(served, client):
    _, _, lm = served
    ask(client, "", max_new_tokens=4)
    client.predict("smollm2-135m", "/no/such/dir", "none", api_name="/load_model")
    out = ask(client, PROMPT, max_new_tokens=6)
    assert out["status"].startswith("Turn 1: done in")
    assert answer_text(out["chat_std"]) == generate(lm, PROMPT, standard(), 6).text


def test_model_info_shows_the_untrained_warning(served):
    _, _, lm = served
    from app.ui import model_markdown

    md = model_markdown(lm)
    assert f"`{lm.source}`" in md and f"mask token id {lm.mask_token_id}" in md
    for w in lm.warnings:  # e.g. "not MTP-trained" while assets/ has no trained adapter
        assert w in md
    assert ("not MTP-trained" in md) == (not lm.mtp_trained)


def test_figures_draw_the_pass_records(served):
    from app import figures

    _, _, lm = served
    res = generate(lm, PROMPT, confadapt(0.5, 4), 8)
    fig = figures.passes_figure(res.passes, tau=0.5, k_max=4, label="ConfAdapt")
    assert len(fig["frames"]) == res.forward_passes
    for rec, frame in zip(res.passes, fig["frames"]):
        widths, confs = frame["data"]
        assert widths["y"] == [len(p.kept) for p in res.passes[: rec.index + 1]]
        assert confs["y"] == rec.confidences and len(confs["x"]) == 4
        assert confs["marker"]["color"].count(figures.KEPT) == len(rec.kept)
    assert [s["y0"] for s in fig["layout"]["shapes"]] == [0.5]  # the tau line
    assert fig["layout"]["sliders"][0]["active"] == res.forward_passes - 1
    html_ = figures.animated_html(fig)
    assert html_.startswith("<iframe") and f'data-frames="{res.forward_passes}"' in html_
    assert "plotly.min.js" in html_ and len(html_) < 200_000  # plotly.js is loaded, not inlined

    race = figures.race_figure([("standard", res.passes), ("mtp", res.passes)])
    assert race.data[0].y[-1] == res.new_tokens
    assert race.data[0].x[-1] == pytest.approx(res.seconds)
    spans = figures.coloured_blocks(res.passes)
    assert "".join(t for t, _ in spans) == res.text
    assert [int(w) for _, w in spans] == [len(p.kept) for p in res.passes if p.text]


def test_runner_alternates_passes_and_reports_an_honest_speedup(served):
    from app.runner import run_side_by_side
    from app.ui import speedup_markdown

    _, _, lm = served
    ids = lm.prompt_ids("And the n-th square number?")
    strategy = static_k(3, 3)
    order, last = [], None
    for std, mtp in run_side_by_side(lm, ids, ids, strategy, 12):
        now = (std.forward_passes, mtp.forward_passes)
        order.append("std" if last is None or now[0] > last[0] else "mtp")
        last = now
    n_both = min(std.forward_passes, mtp.forward_passes)
    assert order[: 2 * n_both] == ["std", "mtp"] * n_both  # one pass each, in turn
    std_ref = generate(lm, "And the n-th square number?", standard(), 12)
    mtp_ref = generate(lm, "And the n-th square number?", strategy, 12)
    assert (std.text, std.tokens, std.forward_passes) == (std_ref.text, std_ref.new_tokens, std_ref.forward_passes)
    assert (mtp.text, mtp.tokens, mtp.forward_passes) == (mtp_ref.text, mtp_ref.new_tokens, mtp_ref.forward_passes)
    assert all(r.seconds > 0 for r in std.records + mtp.records)
    md = speedup_markdown(std, mtp)
    if std.tokens != mtp.tokens:
        tps = mtp.tokens_per_second / std.tokens_per_second
        assert f"over standard: {tps:.2f}× in tokens/s" in md and "is not a speedup" in md
    else:
        assert f"over standard: {std.seconds / mtp.seconds:.2f}×**" in md


def test_registry_loads_once_and_keeps_going_after_a_bad_source():
    from app.runner import ModelRegistry, RequestError

    reg = ModelRegistry()
    with pytest.raises(RequestError, match="No such local model"):
        reg.get("/no/such/model-dir")
    with pytest.raises(RequestError, match="Unknown quantization"):
        reg.get("smollm2-135m", "3bit")
    lm = reg.get("smollm2-135m", "none")
    assert reg.get("smollm2-135m") is lm and reg.loaded() == [("smollm2-135m", "none")]
