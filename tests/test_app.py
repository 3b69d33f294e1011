"""The app without a browser: a turn through :mod:`app.runner` (no Gradio), its rendering, and the
page's API (``python app.py`` served on loopback, driven with gradio_client).

Models are real: the embedded default (SmolLM2-135M GGUF + the MTP adapter) or tiny random models
with SmolLM2's tokenizer. Answers are compared with the engine's own ``model.decoding.generate``.
Timing is never asserted; the one speed assertion compares two identical computations (static
k = 1 against standard decoding), whose ratio must read 1.00 whatever the load.
"""

from __future__ import annotations

import copy
import json
import html as htmllib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from app import figures, render, ui
from app.runner import (
    APP_MAX_K_MAX,
    APP_MAX_NEW_TOKENS,
    ModelRegistry,
    RequestError,
    SessionRuns,
    estimate_speedup,
    history_after,
    parse_history,
    prepare_turn,
    run_turn,
)
from model.engine.loading import wrap_model
from model.engine.decoding import PassRecord, generate
from model.engine.strategies import confadapt, standard, static_k
from tests.conftest import GSM8K_SAMPLE, make_tiny

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
N_NEW = 12
PROMPT = "What is 7 times 8? Answer with the number."


@pytest.fixture(scope="module")
def registry():
    """A registry holding the default model (SmolLM2 + adapter), loaded once for the module."""
    reg = ModelRegistry()
    try:
        reg.get("smollm2-135m")
    except RequestError as e:
        pytest.skip(f"default model unavailable: {e}")
    return reg


@pytest.fixture(scope="module")
def lm(registry):
    return registry.get("smollm2-135m")


def finish(turn, should_stop=lambda: None):
    """Run a turn to its end; returns (states, last state)."""
    states = list(run_turn(turn, should_stop))
    return states, states[-1]


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(message=""), "The message is empty"),
        (dict(message="   \n "), "The message is empty"),
        (dict(message="x" * 20_000), "The message is 20,000 characters long"),
        (dict(tau=1.5), "tau must be in [0, 1], got 1.5"),
        (dict(tau=-1), "tau must be in [0, 1], got -1"),
        (dict(tau="abc"), "tau must be a number in [0, 1], got 'abc'"),
        (dict(k_max=0), "k_max must be from 1 to 32, got 0"),
        (dict(k_max=33), "k_max must be from 1 to 32, got 33"),
        (dict(k_max=2.5), "k_max must be a whole number, got 2.5"),
        (dict(k_max="", strategy="lossless"), "k_max must be a whole number, got ''"),
        (dict(strategy="static k", k=33), "k must be from 1 to 32, got 33"),
        (dict(strategy="standard"), "The right pane needs an MTP strategy"),
        (dict(strategy="beam"), "Unknown strategy 'beam'"),
        (dict(max_new_tokens=0), "max_new_tokens must be from 1 to 1024, got 0"),
        (dict(max_new_tokens=100_000), "max_new_tokens must be from 1 to 1024, got 100000"),
        (dict(max_new_tokens=-3), "max_new_tokens must be from 1 to 1024, got -3"),
        (dict(history="hello"), "The history must be a list of messages, got str"),
        (dict(history=[{"role": "robot", "content": "x"}]), "History item 1: role must be user, assistant or system"),
        (dict(history=[{"role": "user", "content": 3}]), "History item 1: the content must be text"),
        (dict(message="hello " * 2_500), "this demo prefills at most 2,048 tokens"),
    ],
)
def test_bad_requests_are_refused_with_the_value_named(registry, kwargs, expected):
    args = dict(message="hi", history=[], strategy="ConfAdapt", tau=0.9, k_max=4, k=3, max_new_tokens=8)
    args.update(kwargs)
    with pytest.raises(RequestError) as err:
        prepare_turn(registry, **args)
    assert expected in str(err.value)


def test_limits_are_the_apps_and_tau_zero_is_valid(registry, lm):
    assert (APP_MAX_K_MAX, APP_MAX_NEW_TOKENS) == (32, 1024)
    turn = prepare_turn(registry, "hi", [], "ConfAdapt", 0, 32, None, 1024)
    assert turn.strategy.tau == 0.0 and turn.strategy.k_max == 32 and turn.max_new_tokens == 1024
    # k_max defaults to the adapter's trained k_max
    assert prepare_turn(registry, "hi", [], "lossless", 0.9, None).strategy.k_max == min(lm.default_k_max, 32)
    # the parameters a strategy does not use are not checked
    assert prepare_turn(registry, "hi", [], "static k", "junk", "junk", 2).strategy.k == 2


def test_history_forms():
    plain = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!", "mtp": "Hey!"}]
    assert parse_history(plain) == plain
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    assert parse_history(parts) == [{"role": "user", "content": "Hello"}]
    assert parse_history([["Hello", "Hi!"]]) == plain[:1] + [{"role": "assistant", "content": "Hi!"}]
    assert parse_history(None) == [] and parse_history([]) == []


# ---------------------------------------------------------------------------- a turn without Gradio
def test_turn_matches_the_engine_and_alternates_in_abba_order(registry, lm):
    turn = prepare_turn(registry, PROMPT, [], "ConfAdapt", 0.9, 4, 3, N_NEW)
    assert turn.prompt_ids == lm.prompt_ids(PROMPT) and turn.number == 1
    states, last = finish(turn)
    assert [s.phase for s in states[:-1]] == ["running"] * (len(states) - 1) and last.phase == "done"
    assert states[0].last is None and not states[0].standard.passes  # the turn announces itself first
    std_ref, mtp_ref = generate(lm, PROMPT, standard(), N_NEW), generate(lm, PROMPT, confadapt(0.9, 4), N_NEW)
    assert (last.standard.text, last.standard.token_ids) == (std_ref.text, std_ref.token_ids)
    assert (last.mtp.text, last.mtp.token_ids) == (mtp_ref.text, mtp_ref.token_ids)
    assert last.standard.forward_passes == std_ref.forward_passes and last.mtp.forward_passes == mtp_ref.forward_passes
    order = [s.last for s in states[1:-1]]
    both = 2 * min(std_ref.forward_passes, mtp_ref.forward_passes)
    expected = [("standard", "mtp") if i % 2 == 0 else ("mtp", "standard") for i in range(both // 2)]
    assert order[:both] == [name for pair in expected for name in pair]  # ABBA: neither side always first
    assert last.speed is not None and last.speed.ratio > 0


def test_second_turn_answers_the_same_conversation_on_both_sides(registry, lm):
    """Like with like. Both sides of turn 2 answer the same prompt: the conversation whose
    earlier answer is the standard one; the MTP side's own earlier answer is kept for its pane only."""
    first = finish(prepare_turn(registry, "Name a colour.", [], "static k", k=2, max_new_tokens=8))[1]
    hist = history_after(first)
    assert hist == [{"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": first.standard.text, "mtp": first.mtp.text}]
    turn2 = prepare_turn(registry, "Name another one.", hist, "static k", k=2, max_new_tokens=8)
    conversation = [hist[0], {"role": "assistant", "content": first.standard.text},
                    {"role": "user", "content": "Name another one."}]
    assert turn2.number == 2 and turn2.prompt_ids == lm.prompt_ids(conversation)
    second = finish(turn2)[1]
    assert second.standard.text == generate(lm, conversation, standard(), 8).text
    assert second.mtp.text == generate(lm, conversation, static_k(2), 8).text
    # the MTP pane shows its own earlier answer and says the context was the standard one
    pane = render.pane_html(history_after(second), None, None, side="mtp", title="MTP")
    assert htmllib.escape(first.mtp.text, quote=True) in pane
    assert ("continues from the standard answer" in pane) == (first.mtp.text != first.standard.text)


def test_stop_and_clear_end_a_turn_with_a_stated_phase(registry):
    reasons = iter([None, None, None, "stopped"])
    states, last = finish(prepare_turn(registry, "Tell me a story.", [], "ConfAdapt", 0.9, 4, 3, 64),
                          lambda: next(reasons, "stopped"))
    assert last.phase == "stopped" and len(states) == 5  # the start, three passes, the stop
    assert last.standard.new_tokens + last.mtp.new_tokens == 3 and not last.standard_done
    assert history_after(last)[-1]["content"] == last.standard.text  # partial answers stay
    text, kind = render.turn_status(last)
    assert text.startswith("⏹ Turn 1: stopped") and kind == "info"
    cleared = finish(prepare_turn(registry, "Tell me a story.", [], "ConfAdapt", 0.9, 4, 3, 64),
                     lambda: "cleared")[1]
    assert cleared.phase == "cleared" and history_after(cleared) == []


def test_one_run_per_session():
    runs = SessionRuns()
    first = runs.begin("s1")
    assert first is not None and runs.begin("s1", wait_if_stopping=0.1) is None  # busy: refused
    assert runs.begin("s2") is not None  # other sessions are independent
    assert runs.request_stop("s1") and first.stop_reason() == "stopped"
    threading.Timer(0.2, first.release).start()
    second = runs.begin("s1", wait_if_stopping=5)  # a stopping run is waited for
    assert second is not None and second is not first and first.ended.is_set()
    runs.request_stop("s1", "cleared")
    runs.request_stop("s1", "stopped")
    assert second.stop_reason() == "cleared"  # Clear wins over Stop
    second.release()
    assert not runs.request_stop("s1") and runs.begin(None) is not None


# ---------------------------------------------------------------------------- lossless (task B)
FP32 = ("smollm2-135m", "none", "float32")


def test_lossless_turn_equals_standard_and_its_figure_marks_the_drafts(registry):
    """In float32 the lossless side's answer is standard decoding's to the bit."""
    prompt = "Write a Python function that returns the n-th Fibonacci number iteratively."
    last = finish(prepare_turn(registry, prompt, [], "lossless", 0.9, 4, 3, 24, FP32))[1]
    lm32 = registry.get(*FP32)
    assert lm32.dtype == torch.float32
    assert last.strategy.verifies and last.identical and last.mtp.text == generate(lm32, prompt, standard(), 24).text
    assert "identical answers: lossless" in render.speed_html(last)
    fig = figures.passes_figure(last.mtp.passes, last.strategy)
    assert len(fig["frames"]) == last.mtp.forward_passes
    for rec, frame in zip(last.mtp.passes, fig["frames"]):
        colours = frame["data"][1]["marker"]["color"]
        assert colours.count(figures.DRAFT_OK) == min(rec.drafts_accepted, len(rec.kept))
        assert colours.count(figures.DRAFT_BAD) == (1 if rec.correction is not None else 0)
        assert colours.count(figures.OWN) == (1 if len(rec.kept) > rec.drafts_accepted else 0)
        labels, heights = frame["data"][1]["x"], frame["data"][1]["y"]
        assert [x.startswith("d") for x in labels[: rec.fed_drafts]] == [True] * rec.fed_drafts
        assert heights[: rec.fed_drafts] == rec.draft_confidences  # the model's confidence at each draft's place
    assert "shapes" not in fig["layout"] or not fig["layout"]["shapes"]  # no tau line when verifying
    assert any(r.correction is not None for r in last.mtp.passes) or any(r.drafts_accepted for r in last.mtp.passes)


def test_lossless_answer_ahead_of_standard_is_identical_so_far(registry):
    """While a turn runs (or after Stop) one side is ahead: a shorter answer that is a prefix of the other
    is not a parting. In float32 lossless decoding never parts, so no running state may say it does."""
    turn = prepare_turn(registry, "Tell me a story about a dragon.", [], "lossless", 0.9, 4, 3, 24, FP32)
    ahead = 0
    for state in run_turn(turn):
        line = render.speed_html(state)
        assert "part at" not in line, line
        if state.speed is not None and not state.identical:
            ahead += 1
            n = min(len(state.standard.token_ids), len(state.mtp.token_ids))
            assert f"identical so far: the first {n} tokens agree" in line, line
    assert state.identical and "identical answers: lossless" in render.speed_html(state)
    assert ahead > 0  # verify keeps more than one token per pass, so it runs ahead of standard decoding


def test_lossless_in_bf16_says_where_and_why_the_answers_part(registry):
    """In bf16 a pass over several tokens rounds differently from a one-token pass: at a near-tie the
    lossless answer can part from standard decoding's, and the page says where and why. (This GSM8K
    problem parted at token 9 on this project's CPUs; elsewhere it may not part at all.)"""
    lm = registry.get("smollm2-135m", "none", "bfloat16")
    question = json.loads(GSM8K_SAMPLE.read_text().splitlines()[4])["question"]
    last = finish(prepare_turn(registry, question, [], "lossless", 0.9, 4, 3, 16, ("smollm2-135m", "none",
                                                                                   "bfloat16")))[1]
    line = render.speed_html(last)
    if last.identical:
        assert "identical answers: lossless" in line
    else:
        i = next(i for i, (a, b) in enumerate(zip(last.standard.token_ids, last.mtp.token_ids)) if a != b)
        assert f"the answers part at token {i + 1}" in line and "in bf16" in line and "in float32 they are identical" in line
    assert lm.dtype == torch.bfloat16


def test_registry_keys_name_the_precision():
    assert ModelRegistry.key("smollm2-135m") == ("smollm2-135m", "none", "auto")
    with pytest.raises(RequestError, match="Unknown precision 'float8'"):
        ModelRegistry.key("smollm2-135m", "none", "float8")


# ---------------------------------------------------------------------------- numbers
def test_speed_is_worded_as_faster_or_slower():
    assert render.times_text(1 / 2.8) == "2.80× slower"
    assert render.times_text(2.31) == "2.31× faster"
    assert render.times_text(0.998) == "1.00× (the same speed)"


def test_speed_line_counters_and_figure_tell_the_rules(registry, lm):
    last = finish(prepare_turn(registry, PROMPT, [], "ConfAdapt", 0.99, 4, 3, 10))[1]
    line = render.speed_html(last)
    word = "faster" if last.speed.ratio > 1.005 else ("slower" if last.speed.ratio < 0.995 else "same speed")
    assert word in line and "90% interval" in line and "effective k" in line
    assert "×" in line and "speedup" not in line.lower()  # never "speedup 0.36×" for a slowdown
    counters = render.counters_html(last.mtp, side="mtp", label="MTP", state="done")
    for name, meaning in render.COUNTER_HELP.items():  # every counter explains itself
        assert f'title="{htmllib.escape(meaning, quote=True)}"' in counters and f">{name}<" in counters
    assert "always" in render.STRATEGY_HELP["ConfAdapt"] and "first proposal" in render.STRATEGY_HELP["ConfAdapt"]
    # the figure marks the first proposal apart: kept whatever its confidence, even under tau
    fig = figures.passes_figure(last.mtp.passes, last.strategy)
    for rec, frame in zip(last.mtp.passes, fig["frames"]):
        bars = frame["data"][1]
        assert bars["marker"]["color"][0] == figures.FIRST and "always kept" in bars["hovertext"][0]
        assert bars["marker"]["color"].count(figures.KEPT) == len(rec.kept) - 1
    assert [s["y0"] for s in fig["layout"]["shapes"]] == [0.99]


def _rec(i: int, seconds: float, kept: int = 1) -> PassRecord:
    return PassRecord(index=i, fed_real=1, fed_masks=0, proposals=[0] * kept, proposal_texts=["a"] * kept,
                      confidences=[1.0] * kept, kept=[0] * kept, text="a" * kept, accepted=kept, seconds=seconds)


def test_speed_estimate_survives_load_spikes_and_drift():
    """Per-pass medians of paired passes. The same computation on both sides reads 1.00
    whatever happens around it: a few passes slowed 5x, load that doubles over the run."""
    import random

    rng = random.Random(1)
    std, mtp = [_rec(0, 0.5)], [_rec(0, 0.5)]
    for i in range(1, 60):
        load = 1 + i / 60  # the machine gets busier
        s, m = 0.05 * load * rng.uniform(0.95, 1.05), 0.05 * load * rng.uniform(0.95, 1.05)
        if i % 9 == 0:
            s *= 5  # another session's burst lands on a standard pass
        std.append(_rec(i, s))
        mtp.append(_rec(i, m))
    sp = estimate_speedup(std, mtp)
    assert sp.ratio == pytest.approx(1.0, abs=0.02) and 0.97 <= sp.low <= sp.ratio <= sp.high <= 1.03
    assert sp.raw_ratio > 1.1  # the plain sums would credit MTP with the spikes
    # an MTP side with 2 tokens per pass at 1.5x the cost of a pass: 2 / 1.5 = 1.33x
    mtp2 = [_rec(0, 0.5, 2)] + [_rec(i, r.seconds * 1.5, 2) for i, r in enumerate(std[1:30], 1)]
    assert estimate_speedup(std, mtp2).pass_cost == pytest.approx(1.5, rel=0.01)


def test_static_k1_reads_the_same_speed_as_standard_beside_another_session(registry, one_torch_thread):
    """Static k = 1 is the same computation as standard decoding; its ratio must read 1.00× within a few
    percent, also while another session generates at the same time (measured 0.996-1.007x alone; under
    3-5 other jobs on 2 cores 0.91x and 1.18x, with 90% intervals of 0.26 width that held 1.0). A live
    timing on a machine shared with other jobs, so the check is "right within the measurement's own
    precision": a precise reading must be 1.00 within 5%, a wide one within 15% unless its 90% interval
    holds 1.0. The deterministic check of the estimator is test_speed_estimate_survives_load_spikes_and_drift."""
    other_done = threading.Event()

    def other_session():
        finish(prepare_turn(registry, "Write a poem about the sea.", [], "ConfAdapt", 0.9, 4, 3, 40))
        other_done.set()

    t = threading.Thread(target=other_session)
    t.start()
    last = finish(prepare_turn(registry, "Write a short story about a lighthouse keeper.", [], "static k", k=1,
                               max_new_tokens=48))[1]
    t.join()
    assert other_done.is_set()
    sp = last.speed
    assert last.standard.token_ids == last.mtp.token_ids and sp.pairs >= 30
    precise = sp.high - sp.low < 0.12  # a measurement precise enough to read: 1.00 within a few percent
    if precise:
        assert sp.ratio == pytest.approx(1.0, abs=0.05), sp
    else:
        assert sp.ratio == pytest.approx(1.0, abs=0.15) or sp.low <= 1.0 <= sp.high, sp
    assert render.speed_html(last).count("static k=1: ") == 1


# ---------------------------------------------------------------------------- rendering
def test_text_is_shown_literally():
    text = "<b>bold</b> <script>alert(1)</script><p>\n${1+1} & done\n```python\ndef f(n):\n    return n\n```\nend"
    out = render.message_html(text)
    assert "<b>" not in out and "<script>" not in out and "<p>" not in out
    assert "&lt;b&gt;bold&lt;/b&gt;" in out and "&lt;script&gt;" in out
    assert '<pre class="mtp-code"><code>def f(n):\n    return n</code></pre>' in out  # indentation kept
    assert htmllib.unescape(re.sub(r"<[^>]+>", "", out)) == text  # nothing lost, nothing added
    unclosed = render.message_html("Here:\n```python\ndef g():\n    pass")
    assert '<pre class="mtp-code"><code>def g():\n    pass</code></pre>' in unclosed


def test_figure1_is_running_text_with_one_span_per_pass(registry, lm):
    last = finish(prepare_turn(registry, PROMPT, [], "ConfAdapt", 0.5, 4, 3, 16))[1]
    out = render.figure1_html(last.mtp.passes, last.strategy)
    spans = re.findall(r'<span class="mtp-blk[^"]*" data-pass="(\d+)" data-kept="(\d+)"(?: style="[^"]*")? '
                       r'title="([^"]*)">(.*?)</span>(?=<span class="mtp-blk|</div>)', out, re.S)
    with_text = [r for r in last.mtp.passes if r.text]
    assert [int(p) for p, _, _, _ in spans] == [r.index + 1 for r in with_text]
    assert [int(w) for _, w, _, _ in spans] == [len(r.kept) for r in with_text]
    shown = "".join(htmllib.unescape(re.sub(r"<[^>]+>", "", body)) for *_, body in spans)
    assert shown == last.mtp.text
    assert all(t.startswith(f"forward pass {p}: ") and "confidences" in t for p, _, t, _ in spans)
    assert 'dir="auto"' in out and "tokens per forward pass" in out
    assert out.count("mtp-multi") == sum(1 for r in with_text if len(r.kept) > 1)  # one-token passes: plain text


def _luminance(hex_colour: str) -> float:
    rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def test_figure_caption_names_every_colour_the_figure_uses():
    """Each colour a ConfAdapt / static k frame can draw has a swatch in the caption above the figure."""
    caption = ui.figure_caption("ConfAdapt")
    for colour in (figures.FIRST, figures.KEPT, figures.CUT, figures.REJECTED):
        assert f"background:{colour}" in caption, colour


def test_block_colours_keep_text_readable():
    for colour in render.KEPT_COLOURS:
        hi, lo = sorted((_luminance(colour), _luminance(render.TEXT_ON_COLOUR)), reverse=True)
        assert (hi + 0.05) / (lo + 0.05) >= 7.0, colour


# ---------------------------------------------------------------------------- engine errors
@pytest.fixture
def tiny_registry(base_tokenizer):
    """A registry whose every source is a fresh tiny random Llama (max 2048 positions)."""
    def loader(source, quantization=None, dtype=None):
        tok = copy.deepcopy(base_tokenizer)
        model = make_tiny(tok)
        if source == "nan":
            with torch.no_grad():
                model.model.norm.weight.fill_(float("nan"))
        return wrap_model(model, tok, source=source)
    return ModelRegistry(loader=loader)


def test_engine_errors_become_messages(tiny_registry):
    # ContextBudgetError: the prompt fits the app's limit but not the model's positions with the answer
    with pytest.raises(RequestError, match=r"max_position_embeddings"):
        prepare_turn(tiny_registry, "hi " * 1990, [], "ConfAdapt", 0.9, 4, 3, 200, ("tiny", "none"))
    # NonFiniteLogitsError: the turn ends in an error state with the engine's message, nothing raised
    last = finish(prepare_turn(tiny_registry, "hi", [], "ConfAdapt", 0.9, 4, 3, 8, ("nan", "none")))[1]
    assert last.phase == "error" and "NaN or infinite logits" in last.error
    text, kind = render.turn_status(last)
    assert kind == "error" and "NaN or infinite logits" in text
    assert history_after(last) == []  # failed before any pass: the conversation is unchanged


# ---------------------------------------------------------------------------- the page's API
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.mark.parametrize(
    ("tau", "k_max", "max_new", "expected"),
    [(-1, 4, 8, "tau must be in [0, 1], got -1"), (0.9, 33, 8, "k_max must be from 1 to 32, got 33"),
     (0.9, 4, 100_000, "max_new_tokens must be from 1 to 1024, got 100000")],
)
def test_api_refuses_out_of_range_values_instead_of_clamping(client, tau, k_max, max_new, expected):
    out = ask(client, "hi", tau=tau, k_max=k_max, max_new_tokens=max_new)
    assert out["result"]["phase"] == "error" and out["result"]["status"].endswith(expected + ".")
    assert "Error" in out["status"] and expected in out["status"]


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
