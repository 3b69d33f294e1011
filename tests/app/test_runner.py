"""A turn without Gradio (app/runner.py): request validation with the value named, the app's limits,
turns that match the engine and alternate passes in ABBA order, later turns, Stop and Clear, one run
per session, the load-robust speed estimate, engine errors as messages.

Models are real: the embedded default (SmolLM2-135M GGUF + the MTP adapter; integration) or tiny
random models with SmolLM2's tokenizer. Answers are compared with the engine's own
``model.engine.decoding.generate``. Timing is never asserted; the one speed assertion compares two
identical computations (static k = 1 against standard decoding), whose ratio must read 1.00 whatever
the load.
"""

from __future__ import annotations

import html as htmllib
import threading

import pytest

from app import render
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
)
from model.engine.decoding import PassRecord, generate
from model.engine.strategies import confadapt, standard, static_k
from tests.app.conftest import N_NEW, PROMPT, finish


# ------------------------------------------------------------------ validation
@pytest.mark.integration
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


@pytest.mark.integration
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


def test_registry_keys_name_the_precision():
    assert ModelRegistry.key("smollm2-135m") == ("smollm2-135m", "none", "auto")
    with pytest.raises(RequestError, match="Unknown precision 'float8'"):
        ModelRegistry.key("smollm2-135m", "none", "float8")


# ---------------------------------------------------------------------- a turn
@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


# ---------------------------------------------------------- the speed estimate
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


@pytest.mark.integration
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


# --------------------------------------------------------------- engine errors
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
