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
    timing on a machine shared with other jobs: 1.00 within 15%, or a 90% interval that holds 1.0. The deterministic check of the estimator is test_speed_estimate_survives_load_spikes_and_drift."""
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
    # Within 15%, or its 90% interval holds 1.0. The suite runs on two workers, so another test process loads
    # the CPU in bursts that no pairing fully cancels: 1.12x with an interval of [1.05, 1.15] was seen once
    # beside a browser test (the interval is a sampling interval, not a bound on load drift).
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


# ------------------------------------------------------------------ empty and invisible input
@pytest.mark.parametrize("text", ["\u200b\u200b\u200d", " \u200b \n\u200d\t", "\ufeff", "\u2060\u200e\u200f",
                                  "\u00ad", "\u202a\u202c", "\u200b\x00\x1b"])
def test_zero_width_messages_are_refused_like_whitespace(text):
    from app.runner import check_message, is_blank

    assert is_blank(text)
    with pytest.raises(RequestError, match="The message is empty: type a question first."):
        check_message(text)
    assert check_message("\u200bhi\u200d") == "\u200bhi\u200d"  # visible text keeps its invisible characters
    assert not is_blank("\u0661")  # an Arabic digit is text


def test_empty_controls_are_named_in_the_users_words():
    from app.runner import app_max_new_tokens, app_strategy

    with pytest.raises(RequestError, match="tau is empty"):
        app_strategy("ConfAdapt", None, 4)
    with pytest.raises(RequestError, match="^k is empty: enter a whole number from 1 to 32.$"):
        app_strategy("static k", 0.9, 4, None)
    for empty in (None, "", "  "):
        with pytest.raises(RequestError, match="^max new tokens is empty: enter a whole number from 1 to 1024.$"):
            app_max_new_tokens(empty)
    assert app_strategy("lossless", None, None, None, 4).k_max == 4  # unused controls may be empty


# ----------------------------------------------------------------------- repetition
def test_repetition_is_detected_in_loops_and_low_variety_only():
    from app.runner import repeats

    assert repeats([5] * 30)  # one token over and over
    assert repeats([1, 2, 3] + [7, 8, 9, 10] * 8)  # a 4-gram loop over the last 32 tokens
    assert repeats(list(range(40)) + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22] * 3)  # 12-gram, 3 times
    assert not repeats([7, 8, 9, 10] * 5)  # 20 tokens: too short to call
    assert not repeats(list(range(100)))  # varied text
    assert not repeats(list(range(20)) + [1, 2] * 5)  # a short run of a loop (10 tokens) is not degenerate
    shuffled = [3, 1, 2, 2, 3, 1, 1, 1, 3, 2, 3, 2, 1, 3, 2, 2, 1, 1, 3, 3, 2, 1, 2, 3, 1, 3, 3, 2, 1, 1, 2, 3,
                2, 1, 3, 1, 2, 2, 3, 3, 1, 2, 1, 3, 3, 1, 2, 2]
    assert repeats(shuffled)  # no loop, but 3 distinct tokens in the last 48: babbling
    assert not repeats(shuffled[:40])  # too short to call either way


# ------------------------------------------------------------------ the timing method
def test_every_timing_figure_follows_one_method():
    """The headline's ratio is the two sides' tok/s ratio, and each side's time is its prefill plus its passes
    at its typical pass; the plain sums are the other measure (spikes included)."""
    import random

    rng = random.Random(3)
    std, mtp = [_rec(0, 0.4)], [_rec(0, 0.45, 2)]
    for i in range(1, 40):
        s, m = 0.05 * rng.uniform(0.9, 1.1), 0.07 * rng.uniform(0.9, 1.1)
        if i % 7 == 0:
            s *= 6  # load spikes on one side only
        std.append(_rec(i, s))
        mtp.append(_rec(i, m, 2 if i % 3 else 1))
    sp = estimate_speedup(std, mtp)
    for side, recs in ((sp.standard, std), (sp.mtp, mtp)):
        assert side.seconds == pytest.approx(side.prefill + (side.passes - 1) * side.per_pass)
        assert side.tokens == sum(len(r.kept) for r in recs) and side.passes == len(recs)
        assert side.measured == pytest.approx(sum(r.seconds for r in recs))
    assert sp.ratio == pytest.approx(sp.mtp.tokens_per_second / sp.standard.tokens_per_second)
    assert sp.mtp.per_pass == pytest.approx(sp.standard.per_pass * sp.pass_cost)
    raw = (sp.mtp.tokens / sp.mtp.measured) / (sp.standard.tokens / sp.standard.measured)
    assert sp.raw_ratio == pytest.approx(raw) and sp.raw_ratio > sp.ratio  # spikes flatter the plain sums


# ------------------------------------------------------------------ quality beside speed
def test_a_finished_turn_is_scored_outside_the_timed_passes(tiny_registry):
    from app.runner import run_turn
    from model.engine.scoring import teacher_nll

    turn = prepare_turn(tiny_registry, "hi there", [], "static k", 0.9, 4, 3, 10, ("tiny", "none"))
    states = list(run_turn(turn))
    last = states[-1]
    assert all(s.quality is None for s in states[:-1]) and last.quality is not None
    for res, nll in ((last.standard, last.quality.standard_nll), (last.mtp, last.quality.mtp_nll)):
        total, n = teacher_nll(turn.lm, turn.prompt_ids, res.token_ids)
        assert nll == pytest.approx(total / n)
    assert last.quality.gap == pytest.approx(last.quality.mtp_nll - last.quality.standard_nll)
    # the pass records hold the passes only: as many as the decoders ran, none for the scoring
    assert len(last.standard.passes) == last.standard.new_tokens and last.speed.standard.passes == len(last.standard.passes)
    # a stopped turn is scored too; a cleared one is not
    reasons = iter([None, None, None, "stopped"])
    stopped = finish(prepare_turn(tiny_registry, "hi there", [], "static k", 0.9, 4, 3, 10, ("tiny", "none")),
                     lambda: next(reasons, "stopped"))[1]
    assert stopped.phase == "stopped" and stopped.quality is not None and stopped.quality.standard_nll is not None
    cleared = finish(prepare_turn(tiny_registry, "hi", [], "static k", 0.9, 4, 3, 10, ("tiny", "none")),
                     lambda: "cleared")[1]
    assert cleared.quality is None


def test_answer_points_come_from_finished_scored_turns(tiny_registry):
    from app.runner import answer_point

    last = finish(prepare_turn(tiny_registry, "hi", [], "ConfAdapt", 0.5, 4, 3, 8, ("tiny", "none")))[1]
    point = answer_point(last)
    assert point["effective_k"] == last.mtp.effective_k and point["nll"] == last.quality.mtp_nll
    assert point["identical"] == last.identical and point["model_key"] == ["tiny", "none", "auto"]
    assert point["tau"] == 0.5 and point["turn"] == 1
    runs = SessionRuns()
    runs.add_point("s", point)
    runs.add_point("s", dict(point, model_key=["other", "none", "auto"]))
    assert runs.points("s", ("tiny", "none", "auto")) == [point] and len(runs.points("s")) == 2
    assert runs.points("t") == [] and runs.points(None) == []


# ------------------------------------------------------------------ lossless: the device's shape
FLAT = {1: 0.030, 2: 0.030, 4: 0.031, 8: 0.032, 16: 0.034}  # width nearly free: a GPU at batch 1
STEEP = {1: 0.030, 2: 0.055, 4: 0.060, 8: 0.080, 16: 0.110}  # a CPU in float32


def _profile(costs, device="cuda:0", native=True):
    from app.device import WidthProfile

    return WidthProfile(costs, device, "float32", native)


def test_lossless_runs_the_shape_chosen_for_this_device_within_the_k_max_box(tiny_registry):
    from model.engine.width import choose_verify_layout, conditional_acceptance

    from app.device import DEFAULT_ACCEPTANCE

    key = ("tiny", "none", "auto")
    tiny_registry.get(*key)
    tiny_registry.facts.put_profile(key, _profile(FLAT))
    turn = prepare_turn(tiny_registry, "hi", [], "lossless", 0.9, 8, 3, 8, key, "fastest here")
    k, blocks, speedup = choose_verify_layout(FLAT, conditional_acceptance(DEFAULT_ACCEPTANCE), 8)
    assert (turn.strategy.k_max, turn.strategy.blocks) == (k, blocks) and k > 1 and blocks is not None
    assert turn.shape.limit == 8 and turn.shape.speedup == pytest.approx(speedup)
    assert "assumed" in turn.shape.source and turn.sides["mtp"].strategy == turn.strategy
    # the k_max box is the upper bound
    assert prepare_turn(tiny_registry, "hi", [], "lossless", 0.9, 2, 3, 8, key, "fastest here").strategy.k_max <= 2
    # fixed layouts at the box's k_max; the shape is not checked where it is not used
    assert prepare_turn(tiny_registry, "hi", [], "lossless", 0.9, 4, 3, 8, key, "linear").strategy.spec == "verify:4"
    assert prepare_turn(tiny_registry, "hi", [], "lossless", 0.9, 4, 3, 8, key, "full tree").strategy.spec == \
        "verify:4:full"
    assert prepare_turn(tiny_registry, "hi", [], "lossless", 0.9, 4, 3, 8, key).strategy.spec == "verify:4"
    with pytest.raises(RequestError, match="Unknown lossless shape 'wide'"):
        prepare_turn(tiny_registry, "hi", [], "lossless", 0.9, 4, 3, 8, key, "wide")
    assert prepare_turn(tiny_registry, "hi", [], "ConfAdapt", 0.9, 4, 3, 8, key, "wide").shape is None
    # where width costs much, no draft pays: lossless runs as standard decoding (k_max 1), and says so
    tiny_registry.facts.put_profile(key, _profile({1: 0.03, 2: 0.06, 4: 0.12, 8: 0.24, 16: 0.48}, "cpu", False))
    turn = prepare_turn(tiny_registry, "hi", [], "lossless", 0.9, 4, 3, 8, key, "fastest here")
    assert turn.strategy.k_max == 1 and turn.shape.speedup == 1.0
    last = finish(turn)[1]
    assert last.identical and last.mtp.forward_passes == last.standard.forward_passes


def test_acceptance_comes_from_the_sweep_else_a_stated_default(tiny_registry):
    from app.device import DEFAULT_ACCEPTANCE

    key = ("tiny", "none", "auto")
    lm = tiny_registry.get(*key)
    facts = tiny_registry.facts
    assert facts.acceptance(key, lm) == (DEFAULT_ACCEPTANCE, "assumed (no sweep for this checkpoint yet)")
    sweep = {"points": [{"name": "verify", "strategy": "verify:4", "k_max": 4, "acceptance_by_position": [0.5, 0.3, None]},
                        {"name": "verify", "strategy": "verify:4:full", "k_max": 4, "acceptance_by_position": [0.9]}]}
    facts.put_sweep(key, sweep)
    acc, source = facts.acceptance(key, lm)
    assert acc == (0.5, 0.3, 0.0) and source == "the trade-off measured here (lossless k_max 4)"
    assert facts.sweep(key, lm) == (sweep, "measured")


def test_a_sweep_is_measured_pass_by_pass_under_the_forward_lock(tiny_registry):
    """The page's "Measure the trade-off": run_sweep on a view whose every pass (and the teacher's) takes the
    app's lock, so that it never overlaps another session's timed pass nor switches its adapter off."""
    import threading

    from app.device import ModelFacts, locked_view

    class CountingLock:
        def __init__(self):
            self.lock, self.entered = threading.Lock(), 0

        def __enter__(self):
            self.lock.acquire()
            self.entered += 1

        def __exit__(self, *exc):
            self.lock.release()

    key = ("tiny", "none", "auto")
    lm = tiny_registry.get(*key)
    lock = CountingLock()
    facts = ModelFacts(lock)
    seen = []
    sweep = facts.measure_sweep(key, lm, ["hi", "Name a colour."], taus=(0.5, 0.9), max_new_tokens=6,
                                on_progress=lambda done, total: seen.append((done, total)))
    assert [p["name"] for p in sweep["points"]] == ["standard", "confadapt", "confadapt", "verify"]
    assert seen[-1] == (8, 8) and facts.sweep(key, lm) == (sweep, "measured")
    generations = 8  # 2 prompts x (standard + 2 ConfAdapt + lossless)
    assert lock.entered >= 2 * 6 + generations  # standard's 6 passes per prompt, and one scoring pass per answer
    view = locked_view(lm, lock)
    assert view.model is lm.model and view._fast is lm._fast  # the same weights and fast-path structures


def test_a_message_sent_right_after_stop_waits_for_the_stop():
    import time

    runs = SessionRuns()
    first = runs.begin("s")
    threading.Timer(0.2, lambda: (first.request_stop(), threading.Timer(0.2, first.release).start())).start()
    t0 = time.monotonic()
    second = runs.begin("s", wait_for_stop=2.0)  # Stop arrives 0.2 s later; the run ends 0.2 s after that
    assert second is not None and second is not first and time.monotonic() - t0 < 2.0
    second.release()
    busy = runs.begin("s")
    assert runs.begin("s", wait_for_stop=0.2) is None  # no Stop comes: refused after the grace
    busy.release()


# ---------------------------------------------------------- Stop and Clear across a process boundary
def _turns_in_another_process(tokenizer, stop_dir: str, run_ids: list[str], conn) -> None:
    """A generation worker as ZeroGPU runs one (another process): each turn's passes run here, Stop / Clear
    arrive only through the run's stop flag file. After every state it reports the passes so far and waits
    for the parent's go, so the parent knows exactly which pass the flag preceded."""
    import torch

    from app import runner
    from model.engine.loading import wrap_model
    from tests.conftest import make_tiny

    torch.set_num_threads(1)
    runner.STOP_DIR = __import__("pathlib").Path(stop_dir)  # a forked worker inherits it; a spawned one is told
    registry = ModelRegistry(loader=lambda source, quantization=None, dtype=None:
                             wrap_model(make_tiny(tokenizer), tokenizer, source=source))
    for run_id in run_ids:
        turn = prepare_turn(registry, "Tell me a long story.", [], "ConfAdapt", 0.9, 4, 3, 200)
        for state in runner.run_turn(turn, lambda: runner.stop_requested(run_id)):
            n = len(state.standard.passes) + len(state.mtp.passes)
            if state.final:
                conn.send(("final", state.phase, n))
                break
            conn.send(("pass", n))
            conn.recv()


def test_stop_and_clear_reach_a_generation_in_another_process(base_tokenizer):
    """The passes run in a separate process: Stop (then Clear, on the next turn) written by this process after
    pass 3 ends the turn before pass 4, with the phase it names."""
    import copy
    import multiprocessing

    from app import runner

    runs = SessionRuns()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    tickets = []
    for reason in ("stopped", "cleared"):
        tickets.append(runs.begin(f"s-{reason}"))
    worker = ctx.Process(target=_turns_in_another_process,
                         args=(copy.deepcopy(base_tokenizer), str(runner.STOP_DIR), [t.run_id for t in tickets],
                               child), daemon=True)
    worker.start()
    try:
        for ticket, reason in zip(tickets, ("stopped", "cleared")):
            while True:
                assert parent.poll(180), "the worker went silent"
                msg = parent.recv()
                if msg[0] == "final":
                    break
                if msg[1] == 3:
                    assert runs.request_stop(ticket.session, reason)
                parent.send("go")
            assert msg == ("final", reason, 3)  # no pass after the flag
            assert runner.stop_requested(ticket.run_id) == reason
            ticket.release()
            assert runner.stop_requested(ticket.run_id) is None  # the flag goes with the run
    finally:
        worker.join(30)
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode == 0


# ---------------------------------------------------------- ZeroGPU
def test_gpu_seconds_follow_the_calls_own_arguments():
    """ZeroGPU's duration comes from the turn's arguments: longer answers, wider passes and larger models ask for
    more, within [15 s, the cap]; unreadable values fall back instead of raising (it runs before validation)."""
    from app.runner import GPU_SECONDS_MAX, gpu_seconds

    def secs(max_new, k_max=4, source="smollm2-135m", shape="linear"):
        return gpu_seconds("hi", [], "ConfAdapt", 0.9, k_max, 3, max_new, (source, "none", "auto"), "run", shape)

    big = "jwkirchenbauer/L3-1-8B-Magpie-MTP"
    assert 15 <= secs(16) <= secs(512) <= secs(1024) <= GPU_SECONDS_MAX
    assert secs(1024, source=big) > secs(1024) and secs(256, source=big) > secs(64, source=big)
    assert secs(256, k_max=16, source=big, shape="full tree") >= secs(256, k_max=16, source=big)
    assert 15 <= secs("abc", k_max="x") <= GPU_SECONDS_MAX


def test_nothing_touches_cuda_when_the_app_is_imported():
    """On ZeroGPU the main process must not initialise CUDA: importing the app (and the engine) never does."""
    import subprocess
    import sys

    code = ("import torch\n"
            "def refuse(*a, **k): raise RuntimeError('CUDA initialised at import')\n"
            "torch.cuda._lazy_init = refuse\n"
            "import app, app.ui, app.runner, app.device, model.engine.loading\n"
            "assert not torch.cuda.is_initialized()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=str(__import__("tests.conftest", fromlist=["ROOT"]).ROOT))
    assert r.returncode == 0, r.stderr[-2000:]


# ------------------------------------------------------ a side that runs on after the other has ended
def test_the_standard_side_runs_at_its_own_typical_pass_when_mtp_ends_early():
    """static k=3 on a loaded CPU: the MTP answer ends after 20 passes, standard decoding runs 121 more. The
    standard side's typical pass is the median of all its own passes, not of the 20 that ran beside MTP while the
    CPU was busy (it read 9.4 tok/s where it ran 122 tokens at 16.6 tok/s); the pass cost still comes from the
    pairs, so MTP's typical pass is that median times the paired cost."""
    import statistics

    std = [_rec(0, 0.1)] + [_rec(i, 0.1) for i in range(1, 21)] + [_rec(i, 0.05) for i in range(21, 122)]
    mtp = [_rec(0, 0.11, 3)] + [_rec(i, 0.11, 3) for i in range(1, 21)]
    sp = estimate_speedup(std, mtp)
    own = statistics.median(r.seconds for r in std[1:])
    assert sp.standard.per_pass == pytest.approx(own) == pytest.approx(0.05)
    assert sp.pass_cost == pytest.approx(1.1) and sp.mtp.per_pass == pytest.approx(own * 1.1)
    measured_tps = sp.standard.tokens / sp.standard.measured
    # the counters' tok/s describe passes the standard side ran: no slower than its own plain sum says
    assert sp.standard.tokens_per_second >= measured_tps
    assert sp.ratio == pytest.approx(sp.mtp.tokens_per_second / sp.standard.tokens_per_second)
    # the interval resamples the same way: it holds the ratio
    assert sp.low <= sp.ratio <= sp.high


def test_one_pair_gets_no_interval_and_a_headline_against_the_sums_says_why():
    """One paired pass: the interval says there are too few pairs (how many, and how many it needs), and a
    headline that points the other way from the measured sums says so and why."""
    from app.runner import MIN_PAIRS_FOR_INTERVAL, Quality, Turn, TurnState
    from model.engine.decoding import GenerationResult
    from model.engine.strategies import static_k
    from types import SimpleNamespace

    std = [_rec(0, 0.1)] + [_rec(i, 0.05) for i in range(1, 7)] + [_rec(i, 0.3) for i in range(7, 12)]
    mtp = [_rec(0, 0.1), _rec(1, 0.06)]
    sp = estimate_speedup(std, mtp)
    assert sp.pairs == 1 and sp.low is None and sp.ratio < 1 < sp.raw_ratio

    def res(recs, spec):
        ids = [0] * sum(len(r.kept) for r in recs)
        return GenerationResult(text="a" * len(ids), token_ids=ids, passes=recs, strategy=spec)

    turn = Turn(lm=SimpleNamespace(source="synthetic"), strategy=static_k(3), max_new_tokens=64, history=[],
                message="hi", prompt_ids=[1, 2, 3], number=1)
    state = TurnState(turn, res(std, "standard"), res(mtp, "static:3"), True, True, "done",
                      quality=Quality(0.4, 0.4))
    line, _ = render.headline(state)
    assert f"{1 / sp.ratio:.2f}× slower" in line and f"measured sums read {sp.raw_ratio:.2f}× faster" in line
    assert "1 pair of passes" in line
    html = render.speed_html(state)
    assert f"no interval from 1 pair of passes (it needs {MIN_PAIRS_FOR_INTERVAL})" in html
    # agreeing directions: no caveat in the headline
    same = TurnState(turn, res(std[:7], "standard"), res(mtp, "static:3"), True, True, "done",
                     quality=Quality(0.4, 0.4))
    assert "measured sums" not in render.headline(same)[0]


# ------------------------------------------------------------------ a hub id without the Hub
def test_a_hub_id_fails_at_once_when_hf_hub_offline_is_set():
    """HF_HUB_OFFLINE set (the tests set it) and the checkpoint not in the local cache: refused at once, naming
    the reason, without asking the network."""
    import time

    from model.engine.loading import load_checkpoint
    from model.errors import CheckpointError

    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint("nobody-here/not-a-cached-model")
    assert time.monotonic() - t0 < 3.0
    assert "HF_HUB_OFFLINE is set" in str(err.value) and "not in the local cache" in str(err.value)


@pytest.fixture
def silent_hub(monkeypatch):
    """A Hugging Face endpoint on loopback that accepts connections and never answers until released:
    (release event, endpoint). HF_HUB_OFFLINE is unset for the test."""
    import socket

    import huggingface_hub.constants as hf

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    release, held = threading.Event(), []

    def serve():
        server.settimeout(0.2)
        while not release.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass
        for conn in held:
            conn.close()  # no answer: the connection ends

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf, "ENDPOINT", endpoint)
    yield release, endpoint
    release.set()
    thread.join(timeout=5)
    server.close()


def test_a_hub_id_fails_after_the_probe_when_the_hub_does_not_answer(silent_hub, monkeypatch):
    """A Hub that does not answer: the load is refused after the probe's few seconds (it took 69.6 s of
    transformers' retries), naming the endpoint and the reason."""
    import time

    from model.engine import loading
    from model.errors import CheckpointError

    monkeypatch.setattr(loading, "HUB_PROBE_SECONDS", 1.0)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        loading.load_checkpoint("nobody-here/not-a-cached-model")
    assert time.monotonic() - t0 < 4.0
    assert f"{silent_hub[1]} did not answer" in str(err.value) and "not in the local cache" in str(err.value)


def test_chats_keep_running_while_a_hub_load_waits(silent_hub, tiny_registry, monkeypatch):
    """While a hub id waits for the Hub, another session's turn runs to its end; then the load fails with the
    reason, as a message for the page."""
    from model.engine import loading

    monkeypatch.setattr(loading, "HUB_PROBE_SECONDS", 60.0)
    release, endpoint = silent_hub
    tiny_loader = tiny_registry._loader
    registry = ModelRegistry(loader=lambda source, **kw: tiny_loader(source, **kw) if source == "tiny"
                             else loading.load_checkpoint(source, **kw))
    failure: list[Exception] = []

    def load_hub():
        try:
            registry.get("nobody-here/not-a-cached-model")
        except RequestError as e:
            failure.append(e)

    loader = threading.Thread(target=load_hub)
    loader.start()
    last = finish(prepare_turn(registry, "hi", [], "ConfAdapt", 0.9, 4, 3, 6, ("tiny", "none")))[1]
    assert last.phase == "done" and loader.is_alive() and not failure  # the turn ended; the load still waits
    release.set()  # the Hub ends the connection without an answer
    loader.join(timeout=30)
    assert not loader.is_alive() and f"{endpoint} did not answer" in str(failure[0])
