"""The app in a real browser: Playwright driving Debian's Chromium (headless, loopback only).

Runs the real default model (SmolLM2 GGUF) served in-process; answers are compared with the
engine's own ``model.decoding.generate`` on the same loaded model. Screenshots are written to
``test-artifacts/`` (gitignored) and their paths printed.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import time
from pathlib import Path

import pytest

from model.decoding import confadapt, generate, standard

pytestmark = [pytest.mark.integration, pytest.mark.browser]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 150_000

JS_FRAMES = """() => {
  const f = document.querySelector('#passes-figure iframe');
  const gd = f && f.contentDocument && f.contentDocument.querySelector('.plotly-graph-div');
  return gd && gd._transitionData ? gd._transitionData._frames.length : -1;
}"""
JS_SLIDER = """() => {
  const gd = document.querySelector('#passes-figure iframe').contentDocument.querySelector('.plotly-graph-div');
  return gd._fullLayout.sliders[0].active;
}"""
JS_ANSWERS = """(sel) => Array.from(document.querySelectorAll(sel + ' [data-testid="bot"] .message-content'))
  .map(e => e.textContent)"""
JS_COLOURED = """() => Array.from(document.querySelectorAll('#coloured-answer .token .text'))
  .map(e => e.textContent).join('')"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """(demo, url, loaded default model): the app served on 127.0.0.1 for this module."""
    from app import build_app, launch

    demo = build_app()
    lm = demo.mtp_registry.get("smollm2-135m", "none")
    _, url, _ = launch(demo, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    yield demo, url, lm
    demo.close()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser, served):
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = ctx.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    pg.goto(served[1])
    pg.wait_for_selector("#message textarea")
    yield pg
    ctx.close()


def set_number(pg, elem_id: str, n: int) -> None:
    """Type ``n`` into a slider's number box."""
    box = pg.locator(f"#{elem_id} input[type=number]")
    box.fill(str(n))
    box.press("Enter")


def set_max_new_tokens(pg, n: int) -> None:
    set_number(pg, "max-new-tokens", n)


def send(pg, text: str) -> None:
    pg.fill("#message textarea", text)
    pg.click("#send")


def wait_status(pg, pattern: str) -> str:
    """Wait until the status line contains ``pattern`` (plain text); return the status text."""
    pg.wait_for_function("(p) => { const s = document.querySelector('#status'); return s && s.innerText.includes(p); }",
                         arg=pattern, timeout=TIMEOUT_MS)
    return pg.inner_text("#status")


def counters(pg, pane: str) -> dict[str, float]:
    """The numbers in a pane's stats table (``#stats-standard`` or ``#stats-mtp``)."""
    heads = [h.strip() for h in pg.locator(f"#{pane} th").all_inner_texts()]
    cells = [float(c) for c in pg.locator(f"#{pane} td").all_inner_texts()]
    return dict(zip(heads, cells))


def answers(pg, chat: str) -> list[str]:
    return pg.evaluate(JS_ANSWERS, f"#{chat}")


def gsm8k_question() -> str:
    path = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    return json.loads(path.read_text().splitlines()[0])["question"]


def test_page_streams_both_panes_figure_and_coloured_answer(page, served, capsys):
    _, _, lm = served
    question = gsm8k_question()
    set_max_new_tokens(page, 20)
    send(page, question)
    status = wait_status(page, "Turn 1: done in")
    assert "Error" not in status

    std, mtp = counters(page, "stats-standard"), counters(page, "stats-mtp")
    for c in (std, mtp):
        assert c["tokens"] > 0 and c["forward passes"] > 0 and c["effective k"] >= 1 and c["tokens/s"] > 0
    std_ref = generate(lm, question, standard(), 20)
    mtp_ref = generate(lm, question, confadapt(0.9, 16), 20)
    assert answers(page, "chat-standard") == [std_ref.text]
    assert answers(page, "chat-mtp") == [mtp_ref.text]
    assert mtp["forward passes"] == mtp_ref.forward_passes and mtp["tokens"] == mtp_ref.new_tokens
    # one frame per forward pass of the MTP side, in the real Plotly object inside the iframe
    page.wait_for_function(f"() => ({JS_FRAMES})() === {int(mtp['forward passes'])}", timeout=30_000)
    # the coloured answer's text is the MTP pane's text
    assert page.evaluate(JS_COLOURED) == answers(page, "chat-mtp")[0]
    assert re.search(r"Wall-clock speedup of .* over standard: [0-9.]+×", page.inner_text("#speedup"))

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "app_gsm8k.png"
    page.screenshot(path=str(shot), full_page=True)
    with capsys.disabled():  # shown in the test output even when pytest captures stdout
        print(f"\nscreenshot: {shot}")

    # Play and Pause work after generation ends
    fig = page.frame_locator("#passes-figure iframe")
    last = page.evaluate(JS_SLIDER)
    assert last == mtp_ref.forward_passes - 1
    fig.get_by_text("Play").click()
    page.wait_for_function(f"() => ({JS_SLIDER})() !== {last}", timeout=10_000)
    fig.get_by_text("Pause").click()
    time.sleep(0.3)
    paused = page.evaluate(JS_SLIDER)
    time.sleep(1.0)
    assert page.evaluate(JS_SLIDER) == paused


def test_four_sessions_at_once_get_their_own_answers(browser, served):
    _, url, lm = served
    prompts = ["What is the capital of France?", "Count from 1 to 5.", "Name a fruit that is yellow.",
               "What is 9 plus 10?"]
    n_new, k_max = 6, 4
    contexts, pages = [], []
    for prompt in prompts:
        ctx = browser.new_context(viewport={"width": 1200, "height": 900})
        pg = ctx.new_page()
        pg.set_default_timeout(TIMEOUT_MS)
        pg.goto(url)
        pg.wait_for_selector("#message textarea")
        set_max_new_tokens(pg, n_new)
        set_number(pg, "k-max", k_max)
        pg.fill("#message textarea", prompt)
        contexts.append(ctx)
        pages.append(pg)
    for pg in pages:  # all four requests in flight together
        pg.click("#send")
    try:
        for pg in pages:
            wait_status(pg, "Turn 1: done in")
        for pg, prompt in zip(pages, prompts):
            user_turns = pg.evaluate("() => Array.from(document.querySelectorAll('#chat-mtp [data-testid=\"user\"]'))"
                                     ".map(e => e.textContent.trim())")
            assert user_turns == [prompt]
            assert answers(pg, "chat-standard") == [generate(lm, prompt, standard(), n_new).text]
            assert answers(pg, "chat-mtp") == [generate(lm, prompt, confadapt(0.9, k_max), n_new).text]
    finally:
        for ctx in contexts:
            ctx.close()


def test_stop_then_new_prompt_is_correct_and_complete(page, served):
    _, _, lm = served
    set_max_new_tokens(page, 300)
    set_number(page, "k-max", 4)
    send(page, "Write a long story about a dragon who learns to bake bread.")
    page.wait_for_function("() => { const c = document.querySelectorAll('#stats-mtp td'); "
                           "return c.length > 0 && parseFloat(c[0].innerText) >= 3; }", timeout=TIMEOUT_MS)
    page.click("#stop")
    wait_status(page, "Stopped")
    time.sleep(1.5)
    frozen = answers(page, "chat-standard")[0]
    time.sleep(1.5)
    assert answers(page, "chat-standard")[0] == frozen  # generation really stopped
    partial_std, partial_mtp = frozen, answers(page, "chat-mtp")[0]
    assert partial_std.strip() and partial_mtp.strip()

    set_max_new_tokens(page, 10)
    send(page, "What is 2 plus 3?")
    wait_status(page, "Turn 2: done in")
    first = "Write a long story about a dragon who learns to bake bread."
    hist_std = [{"role": "user", "content": first}, {"role": "assistant", "content": partial_std},
                {"role": "user", "content": "What is 2 plus 3?"}]
    hist_mtp = [hist_std[0], {"role": "assistant", "content": partial_mtp}, hist_std[2]]
    std_ref, mtp_ref = generate(lm, hist_std, standard(), 10), generate(lm, hist_mtp, confadapt(0.9, 4), 10)
    assert answers(page, "chat-standard") == [partial_std, std_ref.text]
    assert answers(page, "chat-mtp") == [partial_mtp, mtp_ref.text]
    assert counters(page, "stats-standard")["tokens"] == std_ref.new_tokens


def test_bad_inputs_show_messages_and_the_app_keeps_serving(page, served):
    _, url, lm = served
    set_max_new_tokens(page, 8)
    page.click("#send")  # empty message
    assert "The message is empty" in wait_status(page, "Error")

    page.click("#clear")
    wait_status(page, "Cleared")
    send(page, "x" * 20_000)
    assert "20,000 characters" in wait_status(page, "Error")

    page.get_by_text("Model", exact=True).first.click()  # open the Model accordion
    page.fill("#local-path textarea, #local-path input", "/no/such/model-dir")
    page.click("#load-model")
    status = wait_status(page, "No such local model")
    assert "Still using smollm2-135m" in status
    toast = page.locator(".toast-body", has_text="No such local model")  # also a toast, seen wherever scrolled
    toast.first.wait_for(state="visible", timeout=10_000)

    rtl = "مرحبا بالعالم 👋🌍 שלום עולם — what language is this?"
    send(page, rtl)
    status = wait_status(page, "Turn 1: done in")
    assert "Error" not in status
    assert answers(page, "chat-standard") == [generate(lm, rtl, standard(), 8).text]

    from gradio_client import Client  # k_max 0 and 999 can only come through the API

    client = Client(url, verbose=False)
    for bad in (0, 999):
        out = client.predict("hi", [], [], "ConfAdapt", 0.9, bad, 3, 8, api_name="/chat")
        assert f"k_max must be between 1 and 32, got {bad}" in out[-1]

    page.click("#clear")
    wait_status(page, "Cleared")
    send(page, "What is 2 plus 3?")
    wait_status(page, "Turn 1: done in")
    assert answers(page, "chat-standard") == [generate(lm, "What is 2 plus 3?", standard(), 8).text]
    assert answers(page, "chat-mtp") == [generate(lm, "What is 2 plus 3?", confadapt(0.9, 16), 8).text]
