"""The page (app/ui.py): the figure caption, and the page's API — ``python app.py`` served on loopback
(the real default model; integration) or the app with tiny models served in-process — driven with
gradio_client."""

from __future__ import annotations

import html as htmllib
import json as jsonlib
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from app import figures, headline, outputs, render, ui
from model.engine.decoding import generate
from model.engine.strategies import confadapt, standard
from tests.app.conftest import N_NEW, PROMPT, free_port
from tests.conftest import ROOT


# ---------------------------------------------------------- the figure caption
def test_figure_caption_names_every_colour_the_figure_uses():
    """Each colour a ConfAdapt / static k frame can draw has a swatch in the caption above the figure."""
    caption = outputs.figure_caption("ConfAdapt")
    for colour in (figures.FIRST, figures.KEPT, figures.CUT, figures.REJECTED):
        assert f"background:{colour}" in caption, colour


def test_the_space_card_lists_every_checkpoint_the_page_offers():
    """The README's card (``models:``) names each hub checkpoint in the model menu, and the authors' presets."""
    from model.engine.presets import PRESETS

    card = (ROOT / "README.md").read_text().split("---")[1]
    listed = set(re.findall(r"^  - (\S+)$", card.split("models:")[1].split(":")[0], re.M))
    offered = {source for _, source in ui.MODEL_CHOICES if "/" in source}
    assert offered <= listed and {p.hub_id for p in PRESETS} <= offered


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


def ask(client, message, history=(), strategy="ConfAdapt", tau=0.9, k_max=4, k=3, max_new_tokens=N_NEW,
        shape="linear", temperature=0.0, top_p=1.0):
    """One /chat call; returns the outputs as a dict keyed by :data:`app.ui.TURN_OUTPUTS`. Lossless runs the
    linear layout at k_max unless ``shape`` says otherwise (the page's default is "fastest here")."""
    from app.ui import TURN_OUTPUTS

    out = client.predict(message, list(history), strategy, tau, k_max, k, max_new_tokens, shape, temperature, top_p,
                         api_name="/chat")
    assert len(out) == len(TURN_OUTPUTS)
    return dict(zip(TURN_OUTPUTS, out))


def raw_updates(value) -> list:
    """Every Gradio update dict (``{"__type__": "update", ...}``) anywhere inside an API output."""
    if isinstance(value, dict):
        found = [value] if "__type__" in value else []
        return found + [u for v in value.values() for u in raw_updates(v)]
    if isinstance(value, (list, tuple)):
        return [u for v in value for u in raw_updates(v)]
    return []


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
    assert res["speed"]["text"] == headline.times_text(res["speed"]["ratio"])
    assert out["history"][-1] == {"role": "assistant", "content": std_ref.text,
                                                           "mtp": mtp_ref.text}
    figure = jsonlib.loads(out["figure"])  # the pass figure's Plotly JSON, one frame per forward pass
    assert figure["frames"] == len(figure["figure"]["frames"]) == mtp_ref.forward_passes
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
     (0.9, 4, 100_000, "max new tokens must be from 1 to 1024, got 100000")],
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


# ------------------------------------------------------------------ plain API values
@pytest.fixture
def tiny_served(tiny_registry):
    """The app over tiny random models, served in-process: (demo, gradio_client.Client)."""
    from gradio_client import Client

    from app import build_app, launch

    demo = build_app(tiny_registry)
    _, url, _ = launch(demo, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        yield demo, Client(url, verbose=False)
    finally:
        demo.close()


def test_api_outputs_are_plain_values(tiny_served):
    """/chat and /load_model give API clients plain values (never Gradio's update dicts): a finished turn, a
    refused message, an error before the turn, a model that cannot load."""
    demo, c = tiny_served
    out = ask(c, "hi", max_new_tokens=8)
    assert not raw_updates(out) and out["message"] == "" and out["result"]["phase"] == "done"
    assert out["history"][-1]["role"] == "assistant" and isinstance(out["race"], dict)
    assert out["result"]["quality"]["standard_nll"] > 0 and "headline" in out["result"]
    # a zero-width message is refused like whitespace; the message stays (the box keeps it)
    out = ask(c, "\u200b\u200b\u200d ")
    assert not raw_updates(out) and out["result"] == {"phase": "error",
                                                      "status": "The message is empty: type a question first."}
    assert out["message"] == "\u200b\u200b\u200d " and "The message is empty" in out["status"]
    # every call is independent (API and MCP clients): two at once both run, each continuing exactly the history it
    # sends, nothing recorded between them ([] is a new chat, even from the same client)
    from app.ui import TURN_OUTPUTS

    jobs = [c.submit("My name is Bob. Say hello.", [], "ConfAdapt", 0.9, 4, 3, 8, "linear", api_name="/chat"),
            c.submit("What is 2 plus 2?", [], "ConfAdapt", 0.9, 4, 3, 8, "linear", api_name="/chat")]
    outs = [dict(zip(TURN_OUTPUTS, job.result())) for job in jobs]
    assert [o["result"]["phase"] for o in outs] == ["done", "done"] and all(not raw_updates(o) for o in outs)
    assert [o["result"]["turn"] for o in outs] == [1, 1] and [len(o["history"]) for o in outs] == [2, 2]
    again = ask(c, "What is my name?")
    assert again["result"]["turn"] == 1 and again["history"][0]["content"] == "What is my name?"
    follow = ask(c, "And again?", history=outs[0]["history"])
    assert follow["result"]["turn"] == 2 and follow["history"][:2] == outs[0]["history"]
    assert demo.mtp_sessions.current(c.session_hash) is None and demo.mtp_sessions.waiting(c.session_hash) == 0
    # /load_model: (model info, status, k_max), plain also when the model cannot load
    info, status, k_max = c.predict("smollm2-135m", "tiny", "none", "auto", api_name="/load_model")
    assert "Loaded tiny" in status and k_max == 16 and "<code>tiny</code>" in info
    info, status, k_max = c.predict("smollm2-135m", "missing", "none", "auto", api_name="/load_model")
    assert "Still using tiny." in status and k_max == 16 and "<code>tiny</code>" in info


def test_api_lossless_runs_the_devices_shape(tiny_served):
    from model.engine.width import choose_verify_layout, conditional_acceptance

    from app.device import DEFAULT_ACCEPTANCE, WidthProfile

    demo, c = tiny_served
    key = ("smollm2-135m", "none", "auto")
    flat = {1: 0.030, 2: 0.030, 4: 0.031, 8: 0.032, 16: 0.034}
    demo.mtp_registry.facts.put_profile(key, WidthProfile(flat, "cuda:0", "bfloat16", True))
    k, blocks, speedup = choose_verify_layout(flat, conditional_acceptance(DEFAULT_ACCEPTANCE), 6)
    out = ask(c, "hi", strategy="lossless", k_max=6, max_new_tokens=8, shape="fastest here")
    res = out["result"]
    assert res["shape"]["k_max"] == k and res["shape"]["k_max_limit"] == 6 and res["identical"]
    assert res["mtp"]["strategy"] == "verify:6:auto"  # the shape is its choice for a pass alone
    assert res["shape"]["expected_ratio"] == pytest.approx(speedup, abs=1e-4)
    assert {"mean_acceptance_length", "draft_acceptance_rate", "acceptance_by_position"} <= set(res["mtp"])
    assert ask(c, "hi", strategy="lossless", k_max=6, max_new_tokens=8)["result"]["mtp"]["strategy"] == "verify:6"


# ------------------------------------------------------------------ one timing method
def _counter(html: str, name: str) -> float:
    m = re.search(r'data-name="' + re.escape(name) + r'"[^>]*>.*?mtp-counter-value">([^<]*)<', html)
    return float(m.group(1))


@pytest.mark.integration
def test_the_pages_figures_agree_on_a_loaded_cpu(client):
    """With a busy process beside the app, every figure of a turn agrees with the page's one timing method:
    each side's time s = prefill + (passes − 1) × ms/pass, tok/s = tokens ÷ time s, the headline = the ratio of
    the two tok/s; and the plain sums (measured s, the race chart, the headline's "measured sums") agree with
    each other as the different measure they are labelled."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        out = ask(client, "Write a short poem about the sea.", max_new_tokens=32)
    finally:
        busy.kill()
        busy.wait(timeout=30)
    res = out["result"]
    assert res["phase"] == "done"
    tps, exact_tps = {}, {}
    for side, html_out in (("standard", out["stats_std"]), ("mtp", out["stats_mtp"])):
        tokens, passes = _counter(html_out, "tokens"), _counter(html_out, "passes")
        prefill, per_pass = _counter(html_out, "prefill ms") / 1000, _counter(html_out, "ms/pass") / 1000
        time_s, tps[side], measured = _counter(html_out, "time s"), _counter(html_out, "tok/s"), \
            _counter(html_out, "measured s")
        assert time_s == pytest.approx(prefill + (passes - 1) * per_pass, abs=0.006 + 0.0005 * passes)
        assert tps[side] == pytest.approx(tokens / time_s, rel=0.01, abs=0.06)
        timing = res[side]["timing"]
        # the summary carries 3 decimals, the counter 1 of the unrounded value: rounding the summary's value again
        # can land on the other side of a half (18.95004 -> 18.95 -> 18.9 where the counter shows 19.0)
        assert round(timing["seconds"], 2) == time_s and abs(timing["tokens_per_second"] - tps[side]) <= 0.0505
        assert measured == round(res[side]["seconds"], 2) == round(sum(res[side]["pass_seconds"]), 2)
        exact_tps[side] = timing["tokens_per_second"]
    ratio = float(re.search(r'data-ratio="([0-9.]+)"', out["speed"]).group(1))
    # the headline is the ratio of the unrounded tok/s; the shown tok/s are rounded to 0.1, so their ratio
    # can differ from it by that rounding alone (at 2.5 tok/s ±0.05 is 2%): it must lie in the rounding's interval
    assert ratio == pytest.approx(exact_tps["mtp"] / exact_tps["standard"], rel=1e-3)
    assert (tps["mtp"] - 0.05) / (tps["standard"] + 0.05) - 1e-4 <= ratio <= \
        (tps["mtp"] + 0.05) / (tps["standard"] - 0.05) + 1e-4
    assert ratio == pytest.approx(res["speed"]["ratio"], abs=1e-4)
    sentence = htmllib.unescape(re.search(r'<div class="mtp-headline">(.*?)</div>', out["speed"]).group(1))
    # the headline words the ratio to the 4 decimals data-ratio shows (and the API reports): the same words
    assert headline.times_text(ratio) in sentence
    # the different measure: the race chart's ends are the plain sums, and the headline's details say their ratio
    race = jsonlib.loads(out["race"]["plot"])["data"]
    ends = [trace["x"][-1] for trace in race]
    assert ends == pytest.approx([res["standard"]["seconds"], res["mtp"]["seconds"]], abs=1e-5)
    raw = (res["mtp"]["new_tokens"] / ends[1]) / (res["standard"]["new_tokens"] / ends[0])
    assert raw == pytest.approx(res["speed"]["raw_ratio"], rel=1e-3)
    assert any(f"measured sums (race chart; load spikes skew them): {headline.times_text(r)}" in
               htmllib.unescape(out["speed"]) for r in (raw * (1 - 1e-3), raw * (1 + 1e-3)))


def test_the_headline_updates_with_the_counters_while_streaming(tiny_registry):
    """Every update of a running turn that carries the counters carries the headline of the same state (it lagged
    them: it was drawn only when the figures were due)."""
    from app.requests import TurnRequest
    from app.turn import prepare_turn, run_turn

    turn = prepare_turn(tiny_registry, TurnRequest("hi", [], "ConfAdapt", 0.9, 4, 3, 8, ("tiny", "none")))
    running = [s for s in run_turn(turn) if not s.final and s.speed is not None]
    assert running
    for state in running:
        out = dict(zip(ui.TURN_OUTPUTS, outputs.turn_outputs(state, figures_due=False)))
        assert out["stats_std"] == render.counters_html(state.standard, side="standard", label="standard",
                                                        state="done" if state.standard_done else "running",
                                                        timing=state.speed.standard)
        assert out["speed"] == headline.speed_html(state)


def test_api_names_every_output_and_takes_what_the_readme_documents(tiny_served):
    """``view_api()`` names /chat's 15 outputs as :data:`app.ui.TURN_OUTPUTS` and /load_model's three (they read
    ``value_5, value_60, …``); /chat takes the README's vocabulary: the engine's strategy names and lossless shapes
    such as ``0/1/3`` (the page's radio buttons refused both)."""
    demo, c = tiny_served
    api = c.view_api(return_format="dict", print_info=False)["named_endpoints"]
    chat, load = api["/chat"], api["/load_model"]
    assert [p["parameter_name"] for p in chat["parameters"]] == ["message", "history", "strategy", "tau", "k_max", "k",
                                                                 "max_new_tokens", "shape", "temperature", "top_p"]
    assert [r["label"] for r in chat["returns"]] == list(ui.TURN_OUTPUTS)
    assert [p["parameter_name"] for p in load["parameters"]] == ["choice", "local_path", "quantization", "precision"]
    assert [r["label"] for r in load["returns"]] == ["model_info", "status", "k_max"]
    # README: shapes such as 0/1/3, "full tree", and the engine's names (confadapt, static, verify)
    res = ask(c, "hi", strategy="lossless", k_max=4, max_new_tokens=6, shape="0/1/3")["result"]
    assert res["phase"] == "done" and res["mtp"]["strategy"] == "verify:4:0/1/3" and res["identical"]
    res = ask(c, "hi", strategy="verify", k_max=4, max_new_tokens=6, shape="full tree")["result"]
    assert res["phase"] == "done" and res["mtp"]["strategy"] == "verify:4:full"
    res = ask(c, "hi", strategy="confadapt", tau=0.5, max_new_tokens=6)["result"]
    assert res["phase"] == "done" and res["mtp"]["strategy"] == "confadapt:0.5:4"
    res = ask(c, "hi", strategy="static", k=2, max_new_tokens=6)["result"]
    assert res["phase"] == "done" and res["mtp"]["strategy"] == "static:2"
    # sampling: both sides draw with the turn's seed; the headline never claims an identical answer
    res = ask(c, "hi", strategy="lossless", k_max=4, max_new_tokens=6, temperature=0.8, top_p=0.9)["result"]
    assert res["phase"] == "done" and res["sampling"]["temperature"] == 0.8 and res["sampling"]["top_p"] == 0.9
    assert isinstance(res["sampling"]["seed"], int) and "identical" not in res["headline"]
    assert "same distribution as standard sampling" in res["headline"]
    out = ask(c, "hi", temperature=3.5)
    assert out["result"]["phase"] == "error" and "temperature must be from 0 (greedy) to 2" in out["result"]["status"]
    # what the README does not document is refused by the app, in its words, as a plain value
    out = ask(c, "hi", strategy="lossless", k_max=4, shape="zigzag")
    assert out["result"]["phase"] == "error" and "Unknown lossless shape 'zigzag'" in out["result"]["status"]
    # defaults, as view_api states them: a call with the message alone runs
    out = c.predict("hi", api_name="/chat")
    assert dict(zip(ui.TURN_OUTPUTS, out))["result"]["phase"] == "done"
    info, status, k_max = c.predict("smollm2-135m", "", "none", "auto", api_name="/load_model")
    assert "Loaded smollm2-135m" in status and isinstance(k_max, (int, float))


# ------------------------------------------------------------------ Stop, then a message: the order of turns
def _chat_of(demo):
    """The page's chat handler (the generator behind Send) of a built app."""
    return next(f.fn for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "chat")


def _request(session: str):
    from types import SimpleNamespace

    return SimpleNamespace(session_hash=session)


def test_clear_takes_the_conversations_points_off_the_trade_off_figure(tiny_registry):
    """Clear empties the conversation and takes its answers' points off the trade-off figure, which it redraws at
    the page's controls (tau marked where the slider is); later answers add points again."""
    from app import build_app

    demo = build_app(tiny_registry, preload=False)
    page, chat, key = demo.mtp_page, _chat_of(demo), ["tiny", "none", "auto"]

    def turn(seq: str) -> dict:
        return [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("hi", [], "ConfAdapt", 0.9, 4, 3, 6, "linear", key,
                                                             seq=seq, request=_request("c"))][-1]

    def answers_drawn(fig) -> int:  # markers of the session's answers, one per answer in each of the two panels
        return sum(len(t.x) for t in fig.data if (t.name or "").startswith("your answers"))

    done = turn("1")
    assert "Turn 1: done" in done["status"] and answers_drawn(done["tradeoff"]) == 2
    assert len(demo.mtp_sessions.points("c")) == 1
    cleared = dict(zip(ui.TURN_OUTPUTS[1:], page.clear("ConfAdapt", key, 0.5, 4, request=_request("c"))))
    assert "Cleared" in cleared["status"] and demo.mtp_sessions.points("c") == []
    assert answers_drawn(cleared["tradeoff"]) == 0
    assert "Turn 1: done" in turn("2")["status"] and len(demo.mtp_sessions.points("c")) == 1


def test_a_turn_starts_only_after_the_stopped_run_has_ended_and_recorded_its_answer(tiny_registry):
    """The handler's order, step by step (no timing): a message sent while the session's run is going says it waits
    (and takes the message out of the box only if the box still holds it); the run records its partial answer as
    it ends, in the same step; only then does the new turn start, and it continues the conversation with the
    stopped turn in it."""
    import json

    from app import build_app

    demo = build_app(tiny_registry, preload=False)
    sessions, chat = demo.mtp_sessions, _chat_of(demo)
    key = ("tiny", "none", "auto")
    running = sessions.begin("s")  # the previous run, stopping
    running.request_stop("stopped")
    stopped = [{"role": "user", "content": "Tell me a story."},
               {"role": "assistant", "content": "Once upon", "mtp": "Once upon a"}]
    running.record(stopped)
    outputs: list = []
    got = threading.Semaphore(0)

    def send():
        for out in chat("What next?", [], "ConfAdapt", 0.9, 4, 3, 4, "linear", key, request=_request("s")):
            outputs.append(dict(zip(ui.TURN_OUTPUTS, out)))
            got.release()

    sender = threading.Thread(target=send)
    sender.start()
    assert got.acquire(timeout=60)  # the first update: the message waits
    waiting = outputs[0]
    assert "waits for the answer in progress" in waiting["notice"]
    assert json.loads(waiting["message"])["clear"] == "What next?"  # the box's script clears only this message
    assert not got.acquire(timeout=0.3) and sessions.current("s") is running  # nothing more until the run ends
    running.release()  # the run ends: its partial answer is recorded in the same step
    sender.join(timeout=60)
    last = outputs[-1]
    assert last["result"]["phase"] == "done" and last["result"]["turn"] == 2
    assert last["history"][:2] == stopped and last["history"][2] == {"role": "user", "content": "What next?"}
    assert sessions.conversation("s", []) == last["history"]


def test_a_message_refused_during_a_run_stays_in_the_box_and_leaves_the_run_alone(tiny_registry):
    """A message refused while the session's turn is answering (empty, or a bad setting) is refused at once: it
    never waits in the queue, stays in the box, and the notice under the box says why, leaving the status line to
    the running turn (it stayed on the error while the next message waited); with no turn running the status
    line says it, as before."""
    import gradio as gr

    from app import build_app

    demo = build_app(tiny_registry, preload=False)
    sessions, chat = demo.mtp_sessions, _chat_of(demo)
    key = ("tiny", "none", "auto")
    running = sessions.begin("s")
    out = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("   ", [], "ConfAdapt", 0.9, 4, 3, 4, "linear", key,
                                                       request=_request("s"))]
    refused = {"phase": "error", "status": "The message is empty: type a question first."}
    assert len(out) == 1 and out[0]["result"] == refused
    assert "The message is empty" in out[0]["notice"] and out[0]["status"] == gr.skip()
    assert sessions.current("s") is running  # the run goes on untouched
    # a message with a bad setting is refused at once too, in the notice; it never waits, so it is never lost
    # (it used to wait, emptied from the box, and be refused only when its turn came)
    bad = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("second question", [], "ConfAdapt", 0.9, 0, 3, 4, "linear", key,
                                                       request=_request("s"))]
    assert len(bad) == 1 and "k_max must be from 1 to 32, got 0" in bad[0]["notice"]
    assert bad[0]["message"] == gr.skip() and bad[0]["status"] == gr.skip() and sessions.waiting("s") == 0
    running.release()
    idle = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("   ", [], "ConfAdapt", 0.9, 4, 3, 4, "linear", key,
                                                        request=_request("s"))]
    assert "The message is empty" in idle[0]["status"] and idle[0]["notice"] == ""


def test_after_a_turn_a_stray_send_leaves_its_status_and_a_double_click_sends_once(tiny_registry):
    """Once a turn of the session has ended, the status line keeps its outcome: an empty Send (a second click after
    the message was taken from the box) is explained in the notice instead. The message just sent, sent again at
    once (the page's script numbers it REPEAT: a double click on Send), changes nothing and is not answered."""
    import gradio as gr

    from app import build_app
    from app.scripts import REPEAT

    demo = build_app(tiny_registry, preload=False)
    sessions, chat = demo.mtp_sessions, _chat_of(demo)
    key = ("tiny", "none", "auto")
    args = ("ConfAdapt", 0.9, 4, 3, 4, "linear", key)
    done = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("hi", [], *args, seq="1", request=_request("s"))]
    assert done[-1]["result"]["phase"] == "done" and "Turn 1: done" in done[-1]["status"]
    again = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("hi", [], *args, seq=REPEAT, request=_request("s"))]
    assert again == [dict.fromkeys(ui.TURN_OUTPUTS, gr.skip())]
    empty = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("", [], *args, seq="2", request=_request("s"))]
    assert len(empty) == 1 and "The message is empty" in empty[0]["notice"] and empty[0]["status"] == gr.skip()
    assert [m["content"] for m in sessions.conversation("s", []) if m["role"] == "user"] == ["hi"]
    assert sessions.current("s") is None and sessions.waiting("s") == 0
    nxt = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("and then?", [], *args, seq="3", request=_request("s"))]
    assert "Turn 2: done" in nxt[-1]["status"]  # the numbers the script skipped for the repeat leave no gap


def test_a_prompt_over_the_limit_after_a_turn_is_refused_in_the_notice(tiny_registry, monkeypatch):
    """The prompt's length in tokens is checked when its turn starts. Refused then, after a turn of the session, it
    leaves the status line to that turn (as the refusals checked before a message queues do) and says why in the
    notice; the message stays in the box and takes no turn. On a page with no turn yet the status line says it."""
    import gradio as gr

    from app import build_app
    from app import turn as turn_module

    demo = build_app(tiny_registry, preload=False)
    chat = _chat_of(demo)
    args = ("ConfAdapt", 0.9, 4, 3, 4, "linear", ("tiny", "none", "auto"))
    long = "Tell me everything about the history of the bicycle, " * 4
    monkeypatch.setattr(turn_module, "MAX_PROMPT_TOKENS", 40)
    first = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat(long, [], *args, seq="1", request=_request("p"))]
    assert "tokens long; this demo prefills at most 40 tokens" in first[-1]["status"]  # no turn yet: the status
    done = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("hi", [], *args, seq="2", request=_request("p"))]
    assert "Turn 1: done" in done[-1]["status"]
    refused = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat(long, [], *args, seq="3", request=_request("p"))]
    assert refused[-1]["status"] == gr.skip() and "This conversation is" in refused[-1]["notice"]
    assert "this demo prefills at most 40 tokens" in refused[-1]["notice"]
    assert 'data-kind="refused"' in refused[-1]["notice"] and ">⚠ " in refused[-1]["notice"]  # not "waiting"
    assert all(json_of(o["message"]).get("restore", long) == long for o in refused if o["message"] != gr.skip())
    # sent while turn 2 answers, it waits (the box is emptied), then is refused: it goes back into the box
    monkeypatch.setattr(turn_module, "MAX_PROMPT_TOKENS", 2048)
    running = chat("Tell me a long story.", [], *args[:4], 200, *args[5:], seq="4", request=_request("p"))
    next(running)
    monkeypatch.setattr(turn_module, "MAX_PROMPT_TOKENS", 40)  # checked when a turn starts
    waited: list = []
    t = threading.Thread(target=lambda: waited.extend(dict(zip(ui.TURN_OUTPUTS, o)) for o in chat(
        long, [], *args, seq="5", request=_request("p"))))
    t.start()
    while not waited and t.is_alive():
        time.sleep(0.01)
    assert json_of(waited[0]["message"]).get("clear") == long and "waits for the answer" in waited[0]["notice"]
    assert 'data-kind="wait"' in waited[0]["notice"] and ">◴ " in waited[0]["notice"]
    for _ in running:
        pass
    t.join()
    assert json_of(waited[-1]["message"]).get("restore") == long and waited[-1]["status"] == gr.skip()
    assert "this demo prefills at most 40 tokens" in waited[-1]["notice"]
    assert 'data-kind="refused"' in waited[-1]["notice"]
    # an API call has no status line of earlier turns: its status says it, whatever history it sends
    api = dict(zip(ui.TURN_OUTPUTS, demo.mtp_page.chat_api(long, [["hi", "hello"]], *args[:6], model_key=args[6])))
    assert "This conversation is" in api["status"] and api["result"]["phase"] == "error"
    monkeypatch.setattr(turn_module, "MAX_PROMPT_TOKENS", 2048)
    after = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("and then?", [], *args, seq="6", request=_request("p"))]
    assert "Turn 3: done" in after[-1]["status"]  # the refused messages took no turn


def json_of(command) -> dict:
    """A message-box command (:func:`app.outputs.box_command`) as a dict."""
    import json

    return json.loads(command) if isinstance(command, str) and command.startswith("{") else {}


def test_a_turn_that_ends_without_its_last_update_keeps_its_message(tiny_registry):
    """A run whose handler is closed mid-turn (the page went away, an error while drawing) still records its message
    and partial answers before the next turn may start: that turn continues the conversation with it."""
    from app import build_app

    demo = build_app(tiny_registry, preload=False)
    sessions, chat = demo.mtp_sessions, _chat_of(demo)
    key = ("tiny", "none", "auto")
    gen = chat("Tell me a long story.", [], "ConfAdapt", 0.9, 4, 3, 200, "linear", key, request=_request("s"))
    for _ in range(3):
        next(gen)
    gen.close()  # closed mid-turn, before its final update
    assert sessions.current("s") is None
    kept = sessions.conversation("s", [])
    assert kept[0] == {"role": "user", "content": "Tell me a long story."} and kept[1]["role"] == "assistant"
    outs = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("And then?", [], "ConfAdapt", 0.9, 4, 3, 4, "linear", key,
                                                     request=_request("s"))]
    assert outs[-1]["result"]["turn"] == 2 and outs[-1]["history"][:2] == kept
    # a cleared run that is closed keeps no conversation
    gen = chat("Another story.", outs[-1]["history"], "ConfAdapt", 0.9, 4, 3, 200, "linear", key, request=_request("s"))
    next(gen)
    next(gen)
    sessions.request_stop("s", "cleared")
    sessions.remember("s", [])
    gen.close()
    assert sessions.conversation("s", []) == []


def test_clear_that_arrives_while_the_turn_ends_is_not_undone_by_its_last_update(tiny_registry, monkeypatch):
    """Clear pressed after a turn's last pass, while its answers are scored (the final update not sent yet): the
    page says Cleared and nothing the run sends afterwards says otherwise; the conversation stays empty."""
    import app.turn as turn_module
    from app import build_app

    demo = build_app(tiny_registry, preload=False)
    sessions, chat = demo.mtp_sessions, _chat_of(demo)
    scored = turn_module.score_answers

    def score_then_clear(*args, **kwargs):  # the user's Clear lands in the scoring window
        quality = scored(*args, **kwargs)
        assert sessions.request_stop("s", "cleared")
        sessions.remember("s", [])
        return quality

    monkeypatch.setattr(turn_module, "score_answers", score_then_clear)
    outs = [dict(zip(ui.TURN_OUTPUTS, o)) for o in chat("hi", [], "ConfAdapt", 0.9, 4, 3, 4, "linear",
                                                       ("tiny", "none", "auto"), request=_request("s"))]
    assert not any("done in" in str(o["status"]) for o in outs)
    assert "Cleared" in outs[-1]["status"] and outs[-1]["history"] == []  # the page's last word is Clear's
    assert sessions.conversation("s", []) == [] and sessions.current("s") is None


def test_the_chat_is_an_mcp_tool_an_agent_can_read_and_call(tiny_served):
    """``launch`` serves Gradio's MCP server: the chat is the tool ``chat_summary``, whose description and arguments
    come from :meth:`app.page.Page.chat_summary`'s docstring, and an MCP client (the ``mcp`` package) calls it for a
    real turn and gets one small JSON text (both answers, their counts, the speedup, the headline in words), not
    the page's 15 outputs; ``/chat`` stays an API endpoint only."""
    import asyncio
    import json
    import urllib.request

    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    demo, c = tiny_served
    url = c.src.rstrip("/") + "/"
    schema = {t["name"]: t for t in json.loads(urllib.request.urlopen(url + "gradio_api/mcp/schema", timeout=30).read())}
    chat = schema["chat_summary"]
    assert chat["description"].startswith("Answer one chat message twice, with standard decoding and with a multi")
    assert ",," not in json.dumps(schema) and schema["chat_api"]["meta"]["mcp_type"] != "tool"
    props = chat["inputSchema"]["properties"]
    assert list(props) == ["message", "history", "strategy", "tau", "k_max", "k", "max_new_tokens", "shape",
                           "temperature", "top_p"]
    assert "0 to 1" in props["tau"]["description"] and chat["inputSchema"]["required"] == ["message"]
    assert "load_model_api" in schema

    async def call():
        async with streamablehttp_client(url + "gradio_api/mcp/") as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = {t.name for t in (await session.list_tools()).tools}
                out = await session.call_tool("chat_summary", {"message": "hi", "history": [], "max_new_tokens": 6})
                return tools, out

    tools, out = asyncio.run(call())
    assert {"chat_summary", "load_model_api"} <= tools and "chat_api" not in tools and not out.isError
    assert len(out.content) == 1
    text = out.content[0].text
    assert len(text) < 3000  # a small result (the page's outputs were ~120,000 characters of HTML and Plotly)
    result = json.loads(text)
    assert result["phase"] == "done" and result["status"].startswith("Turn 1: done")
    assert set(result["standard"]) == {"text", "new_tokens", "forward_passes", "effective_k", "tokens_per_second"}
    assert result["mtp"]["strategy"].startswith("confadapt") and result["standard"]["new_tokens"] <= 6
    assert isinstance(result["headline"], str) and "<" not in result["status"]


def test_the_tradeoff_star_follows_the_slider_moved_while_a_turn_answers(tiny_registry):
    """A turn sent at tau 0.9 ends after the slider moved to 0.5: its last trade-off figure marks tau 0.5 (where the
    slider is), not the tau the turn started with."""
    from app.page import Page
    from app.sessions import SessionRuns
    from model.engine.strategies import confadapt, standard
    from model.evaluation.sweep import Sweep, SweepPoint

    page = Page(tiny_registry, SessionRuns(), preload=False)
    key = ("tiny", "none", "auto")
    page.registry.get(*key)
    page.facts.put_sweep(key, Sweep("tiny", None, 2, 8, "float32", (
        SweepPoint(standard(), 1.0, 1.0, 1.0), SweepPoint(confadapt(0.5, 4), 2.5, 0.2, 1.5),
        SweepPoint(confadapt(0.9, 4), 1.5, 0.8, 1.1))))
    gen = page.chat("Tell me a story.", [], "ConfAdapt", 0.9, 4, 3, 12, "linear", key, request=_request("s"))
    next(gen)  # the turn runs
    page.on_tau("ConfAdapt", key, 4, 0.5, request=_request("s"))  # the user moves the slider meanwhile
    last = dict(zip(ui.TURN_OUTPUTS, list(gen)[-1]))
    names = [t.name for t in last["tradeoff"].data]
    assert "tau 0.5 now" in names and "tau 0.9 now" not in names


def test_no_event_updates_an_unchecked_slider(tiny_registry):
    """tau, the temperature and top-p take a number typed past an end (``unchecked_slider``); an event that updated
    one would make Gradio rebuild it for the session without that, and a typed 5 then failed with a 500 and a
    traceback (found after a strategy switch, which showed and hid tau itself). Their containers are updated
    instead; a number past an end still reaches the app, which says why it refuses it."""
    from app import build_app

    demo = build_app(tiny_registry, preload=False)
    unchecked = {"tau", "temperature", "top-p"}
    found = {b.elem_id for b in demo.blocks.values() if getattr(b, "elem_id", None) in unchecked}
    assert found == unchecked
    updated = {(f.name, o.elem_id) for f in demo.fns.values() for o in f.outputs if o.elem_id in unchecked}
    assert updated == set()
    tau = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "tau")
    assert tau.preprocess(5) == 5


@pytest.mark.parametrize("setting", ["MTP_APP_THREADS=-1", "GRADIO_SERVER_PORT=abc"])
def test_a_bad_server_setting_is_one_line_not_a_traceback(setting):
    """``python app.py`` with a server setting typed wrong exits at once with one line naming it."""
    name, value = setting.split("=")
    env = {**os.environ, name: value}
    proc = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: {name}={value!r}: expected a positive whole number"
