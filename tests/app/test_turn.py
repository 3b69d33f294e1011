"""A turn without Gradio (app/turn.py): turns that match the engine and alternate passes in ABBA order, later
turns, Stop and Clear (also from another process), engine errors as messages, the answers scored outside the
timed passes, lossless at the device's shape.

Models are real: the embedded default (SmolLM2-135M GGUF + the MTP adapter; integration) or tiny random models
with SmolLM2's tokenizer. Answers are compared with the engine's own ``model.engine.decoding.generate``."""

from __future__ import annotations

import html as htmllib

import pytest

from app import headline, render
from app.registry import ModelRegistry
from app.requests import TurnRequest
from app.sessions import SessionRuns
from app.turn import history_after, prepare_turn
from model.errors import RequestError
from model.engine.decoding import generate
from model.engine.strategies import confadapt, standard, static_k
from tests.app.conftest import N_NEW, PROMPT, finish


# ---------------------------------------------------------------------- a turn
@pytest.mark.integration
def test_turn_matches_the_engine_and_alternates_in_abba_order(registry, lm):
    turn = prepare_turn(registry, TurnRequest(PROMPT, [], "ConfAdapt", 0.9, 4, 3, N_NEW))
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
    first = finish(prepare_turn(registry, TurnRequest("Name a colour.", [], "static k", k=2, max_new_tokens=8)))[1]
    hist = history_after(first)
    assert hist == [{"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": first.standard.text, "mtp": first.mtp.text}]
    turn2 = prepare_turn(registry, TurnRequest("Name another one.", hist, "static k", k=2, max_new_tokens=8))
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
    # after the last answer nothing continues yet: no note there (turn 1's own pane)
    assert "continues from the standard answer" not in render.pane_html(hist, None, None, side="mtp", title="MTP")


@pytest.mark.integration
def test_stop_and_clear_end_a_turn_with_a_stated_phase(registry):
    reasons = iter([None, None, None, "stopped"])
    states, last = finish(prepare_turn(registry, TurnRequest("Tell me a story.", [], "ConfAdapt", 0.9, 4, 3, 64)),
                          lambda: next(reasons, "stopped"))
    assert last.phase == "stopped" and len(states) == 5  # the start, three passes, the stop
    assert last.standard.new_tokens + last.mtp.new_tokens == 3 and not last.standard_done
    assert history_after(last)[-1]["content"] == last.standard.text  # partial answers stay
    text, kind = headline.turn_status(last)
    assert text.startswith("■ Turn 1: stopped") and kind == "info"  # a glyph every font has (not U+23F9)
    cleared = finish(prepare_turn(registry, TurnRequest("Tell me a story.", [], "ConfAdapt", 0.9, 4, 3, 64)),
                     lambda: "cleared")[1]
    assert cleared.phase == "cleared" and history_after(cleared) == []


# --------------------------------------------------------------- engine errors
def test_engine_errors_become_messages(tiny_registry):
    # ContextBudgetError: the prompt fits the app's limit but not the model's positions with the answer
    with pytest.raises(RequestError, match=r"max_position_embeddings"):
        prepare_turn(tiny_registry, TurnRequest("hi " * 1990, [], "ConfAdapt", 0.9, 4, 3, 200, ("tiny", "none")))
    # NonFiniteLogitsError: the turn ends in an error state with the engine's message, nothing raised
    last = finish(prepare_turn(tiny_registry, TurnRequest("hi", [], "ConfAdapt", 0.9, 4, 3, 8, ("nan", "none"))))[1]
    assert last.phase == "error" and "NaN or infinite logits" in last.error
    text, kind = headline.turn_status(last)
    assert kind == "error" and "NaN or infinite logits" in text
    assert history_after(last) == []  # failed before any pass: the conversation is unchanged


# ------------------------------------------------------------------ quality beside speed
def test_a_finished_turn_is_scored_outside_the_timed_passes(tiny_registry):
    from app.turn import run_turn
    from model.engine.scoring import teacher_nll

    turn = prepare_turn(tiny_registry, TurnRequest("hi there", [], "static k", 0.9, 4, 3, 10, ("tiny", "none")))
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
    stopped = finish(prepare_turn(tiny_registry, TurnRequest("hi there", [], "static k", 0.9, 4, 3, 10, ("tiny", "none"))),
                     lambda: next(reasons, "stopped"))[1]
    assert stopped.phase == "stopped" and stopped.quality is not None and stopped.quality.standard_nll is not None
    cleared = finish(prepare_turn(tiny_registry, TurnRequest("hi", [], "static k", 0.9, 4, 3, 10, ("tiny", "none"))),
                     lambda: "cleared")[1]
    assert cleared.quality is None


def test_answers_cut_at_max_new_tokens_are_named(tiny_registry):
    """An answer that ends at max new tokens (not at a stop token) is said to be cut, in the status and the
    summary; one stopped by the user before the limit is not."""
    last = finish(prepare_turn(tiny_registry, TurnRequest("hi there", [], "static k", 0.9, 4, 3, 10, ("tiny", "none"))))[1]
    assert last.phase == "done" and last.standard.new_tokens == last.mtp.new_tokens == 10
    assert not last.standard.passes[-1].stopped and not last.mtp.passes[-1].stopped  # random weights: no stop token
    text, kind = headline.turn_status(last)
    assert "Both answers were cut at max new tokens (10)" in text and kind == "info"
    summary = headline.summary(last, status=text, kind=kind)
    assert summary["standard"]["cut_at_max_new_tokens"] and summary["mtp"]["cut_at_max_new_tokens"]
    reasons = iter([None, None, "stopped"])
    stopped = finish(prepare_turn(tiny_registry, TurnRequest("hi there", [], "static k", 0.9, 4, 3, 10, ("tiny", "none"))),
                     lambda: next(reasons, "stopped"))[1]
    assert stopped.phase == "stopped" and headline.cut_sides(stopped) == []
    assert "cut at max new tokens" not in headline.turn_status(stopped)[0]


def test_answer_points_come_from_finished_scored_turns(tiny_registry):
    import dataclasses

    from app.quality import answer_point

    last = finish(prepare_turn(tiny_registry, TurnRequest("hi", [], "ConfAdapt", 0.5, 4, 3, 8, ("tiny", "none"))))[1]
    point = answer_point(last)
    assert point.effective_k == last.mtp.effective_k and point.nll == last.quality.mtp_nll
    assert point.identical == last.identical and point.model_key == ("tiny", "none", "auto")
    assert point.tau == 0.5 and point.turn == 1
    runs = SessionRuns()
    runs.add_point("s", point)
    runs.add_point("s", dataclasses.replace(point, model_key=("other", "none", "auto")))
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
    turn = prepare_turn(tiny_registry, TurnRequest("hi", [], "lossless", 0.9, 8, 3, 8, key, "fastest here"))
    k, blocks, speedup = choose_verify_layout(FLAT, conditional_acceptance(DEFAULT_ACCEPTANCE), 8)
    # verify:auto up to the box's k_max; the shape shown is its choice for a pass alone
    assert turn.strategy.spec == "verify:8:auto" and (turn.shape.k_max, turn.shape.blocks) == (k, blocks)
    assert k > 1 and blocks is not None and turn.sides["mtp"].width is tiny_registry.facts.auto_width(key, turn.lm)
    assert turn.shape.limit == 8 and turn.shape.speedup == pytest.approx(speedup)
    assert "assumed" in turn.shape.source and turn.sides["mtp"].strategy == turn.strategy
    # the k_max box is the upper bound
    assert prepare_turn(tiny_registry, TurnRequest("hi", [], "lossless", 0.9, 2, 3, 8, key, "fastest here")).strategy.k_max <= 2
    # fixed layouts at the box's k_max; the shape is not checked where it is not used
    assert prepare_turn(tiny_registry, TurnRequest("hi", [], "lossless", 0.9, 4, 3, 8, key, "linear")).strategy.spec == "verify:4"
    assert prepare_turn(tiny_registry, TurnRequest("hi", [], "lossless", 0.9, 4, 3, 8, key, "full tree")).strategy.spec == \
        "verify:4:full"
    assert prepare_turn(tiny_registry, TurnRequest("hi", [], "lossless", 0.9, 4, 3, 8, key)).strategy.spec == "verify:4"
    with pytest.raises(RequestError, match="Unknown lossless shape 'wide'"):
        prepare_turn(tiny_registry, TurnRequest("hi", [], "lossless", 0.9, 4, 3, 8, key, "wide"))
    assert prepare_turn(tiny_registry, TurnRequest("hi", [], "ConfAdapt", 0.9, 4, 3, 8, key, "wide")).shape is None
    # where width costs much, no draft pays: lossless runs as standard decoding (k_max 1), and says so
    tiny_registry.facts.put_profile(key, _profile({1: 0.03, 2: 0.06, 4: 0.12, 8: 0.24, 16: 0.48}, "cpu", False))
    turn = prepare_turn(tiny_registry, TurnRequest("hi", [], "lossless", 0.9, 4, 3, 8, key, "fastest here"))
    assert turn.shape.k_max == 1 and turn.shape.speedup == 1.0
    last = finish(turn)[1]
    assert last.identical and last.mtp.forward_passes == last.standard.forward_passes


def test_acceptance_comes_from_the_sweep_else_a_stated_default(tiny_registry):
    from app.device import DEFAULT_ACCEPTANCE

    key = ("tiny", "none", "auto")
    lm = tiny_registry.get(*key)
    facts = tiny_registry.facts
    assert facts.acceptance(key, lm) == (DEFAULT_ACCEPTANCE, "assumed (no sweep for this checkpoint yet)")
    from model.engine.strategies import verify
    from model.evaluation.sweep import Sweep, SweepPoint

    sweep = Sweep(None, None, None, None, None, (SweepPoint(verify(4), 1.5, acceptance_by_position=(0.5, 0.3, None)),
                                                 SweepPoint(verify(4, "full"), 1.6, acceptance_by_position=(0.9,))))
    facts.put_sweep(key, sweep)
    acc, source = facts.acceptance(key, lm)
    assert acc == (0.5, 0.3, 0.0) and source == "the trade-off measured here (lossless k_max 4)"
    assert facts.sweep(key, lm) == (sweep, "measured")


def test_a_sweep_is_measured_pass_by_pass_under_the_forward_lock(tiny_registry):
    """The page's "Measure the trade-off": run_sweep on a view whose every pass (and the teacher's) takes the
    app's lock, so that it never overlaps another session's timed pass nor switches its adapter off; the
    teacher's scoring pass, which runs inside the adapter-off context that holds the lock, does not take it
    again (a plain lock: it waited forever)."""
    import threading

    from app.device import ModelFacts, locked_view

    class CountingLock:
        def __init__(self):
            self.lock, self.entered = threading.Lock(), 0

        def __enter__(self):  # a thread that took it again while holding it would wait forever: fail instead
            assert self.lock.acquire(timeout=60), "the lock was taken again by the thread that holds it"
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
    assert [p.name for p in sweep.points] == ["standard", "confadapt", "confadapt", "verify"]
    assert seen[-1] == (8, 8) and facts.sweep(key, lm) == (sweep, "measured")
    generations = 8  # 2 prompts x (standard + 2 ConfAdapt + lossless)
    assert lock.entered >= 2 * 6 + generations  # standard's 6 passes per prompt, and one scoring pass per answer
    view = locked_view(lm, lock)
    assert view.model is lm.model and view._fast is lm._fast  # the same weights and fast-path structures


# ---------------------------------------------------------- Stop and Clear across a process boundary
def _turns_in_another_process(tokenizer, stop_dir: str, run_ids: list[str], conn) -> None:
    """A generation worker as ZeroGPU runs one (another process): each turn's passes run here, Stop / Clear
    arrive only through the run's stop flag file. After every state it reports the passes so far and waits
    for the parent's go, so the parent knows exactly which pass the flag preceded."""
    import torch

    from app import sessions as runner_sessions, turn as runner_turn
    from model.engine.loading import wrap_model
    from tests.conftest import make_tiny

    torch.set_num_threads(1)
    runner_sessions.STOP_DIR = __import__("pathlib").Path(stop_dir)  # a forked worker inherits it; a spawned one is told
    registry = ModelRegistry(loader=lambda source, quantization=None, dtype=None:
                             wrap_model(make_tiny(tokenizer), tokenizer, source=source))
    for run_id in run_ids:
        turn = prepare_turn(registry, TurnRequest("Tell me a long story.", [], "ConfAdapt", 0.9, 4, 3, 200))
        for state in runner_turn.run_turn(turn, lambda: runner_sessions.stop_requested(run_id)):
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

    from app import sessions as runner_sessions

    runs = SessionRuns()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    tickets = []
    for reason in ("stopped", "cleared"):
        tickets.append(runs.begin(f"s-{reason}"))
    worker = ctx.Process(target=_turns_in_another_process,
                         args=(copy.deepcopy(base_tokenizer), str(runner_sessions.STOP_DIR), [t.run_id for t in tickets],
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
            assert runner_sessions.stop_requested(ticket.run_id) == reason
            ticket.release()
            assert runner_sessions.stop_requested(ticket.run_id) is None  # the flag goes with the run
    finally:
        worker.join(30)
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode == 0


# ---------------------------------------------------------------------- long prompts
LONG = " ".join(f"Fact {i}: the sky over city number {i} was clear and blue that morning." for i in range(60))


def test_stop_during_a_long_prefill_acts_within_one_chunk(tiny_registry):
    """A ~1,100-token message is read in chunks of PREFILL_CHUNK tokens, the sides alternating; the states say how
    far the prompt is read; Stop, asked after the second chunk, ends the turn before a third (within one chunk)."""
    from app.turn import run_turn
    from model.engine.decoding import PREFILL_CHUNK

    turn = prepare_turn(tiny_registry, TurnRequest(LONG, [], "ConfAdapt", 0.9, 4, 3, 8, ("tiny", "none", "auto")))
    assert len(turn.prompt_ids) > 4 * PREFILL_CHUNK
    stop_after, chunks, states = 2, [], []
    for state in run_turn(turn, lambda: "stopped" if len(chunks) >= stop_after else None):
        states.append(state)
        if state.prefill is not None and state.last is not None:
            chunks.append(state.prefill)
    assert states[-1].phase == "stopped" and len(chunks) == stop_after
    assert chunks[0] == (PREFILL_CHUNK, 2 * (len(turn.prompt_ids) - 1))  # both sides' prompts, minus the last
    assert chunks[1][0] == 2 * PREFILL_CHUNK and [s.last for s in states[1:3]] == ["standard", "mtp"]
    assert "reading the prompt" in headline.headline(states[2])[0] and "of" in headline.turn_status(states[2])[0]
    assert not states[-1].standard.passes and not states[-1].mtp.passes  # stopped inside the prefill
    # the last headline says the turn ended there, not that the prompt is still being read
    last = headline.headline(states[-1])[0]
    assert "reading the prompt" not in last and "no speed to compare, the turn was stopped" in last, last


def test_a_follow_up_after_a_long_turn_computes_its_own_tokens(tiny_registry):
    """After a turn on a long prompt, the next turn starts both sides from the caches that turn left: each side
    computes only the conversation's new tokens (the answer and the new message), and answers exactly what a turn
    without the caches answers."""
    from app.prefixes import PrefixStore

    store, key = PrefixStore(), ("tiny", "none", "auto")
    first = prepare_turn(tiny_registry, TurnRequest(LONG, [], "ConfAdapt", 0.9, 4, 3, 8, key, session="s"), store)
    last = finish(first)[1]
    store.put("s", key, {n: (d.cache, d.cached_ids) for n, d in first.sides.items()})
    follow = TurnRequest("And then?", history_after(last), "ConfAdapt", 0.9, 4, 3, 8, key, session="s")
    second = prepare_turn(tiny_registry, follow, store)
    reused = second.sides["standard"].reused
    assert reused == second.sides["mtp"].reused >= len(first.prompt_ids)  # both sides alike
    done = finish(second)[1]
    new = len(second.prompt_ids) - reused
    assert done.standard.passes[0].fed_real == new == done.mtp.passes[0].fed_real < 60
    fresh = finish(prepare_turn(tiny_registry, follow.with_(session=None)))[1]
    assert (done.standard.token_ids, done.mtp.token_ids) == (fresh.standard.token_ids, fresh.mtp.token_ids)
    assert store.tokens() == 0  # taken: the turn's decoders own the caches now


def test_the_width_cost_survives_load_and_follows_the_pages_own_passes(tiny_registry):
    """A measurement in which one round ran under a burst of load (its wide pass 3x slower) still reads the true
    ratio (pairs of passes, median of rounds); the page's own turns then refresh it: after a lossless turn the
    profile holds that turn's pairs too, and the shape is chosen from them."""
    from app.device import WidthProfile
    from app.page import Page
    from app.sessions import SessionRuns
    from model.engine.width import WidthCosts

    rounds = {1: [0.010] * 7, 4: [0.0125, 0.0125, 0.0375, 0.0125, 0.0126, 0.0124, 0.0125]}
    prof = WidthProfile({1: 0.010, 4: 0.0125}, "cpu", "bfloat16", True, ratios=WidthCosts.from_rounds(rounds))
    assert prof.ratio(4) == pytest.approx(1.25, abs=0.01)
    key = ("tiny", "none", "auto")
    page = Page(tiny_registry, SessionRuns(), preload=False)
    lm = tiny_registry.get(*key)
    page.facts.put_profile(key, prof)
    before = prof.ratios.count(4) + prof.ratios.count(2) + prof.ratios.count(3)
    *_, last = page.chat("Tell me a story.", [], "lossless", 0.9, 4, 3, 10, "linear", key,
                         request=type("R", (), {"session_hash": "w"})())
    pairs = sum(prof.ratios.count(w) for w in range(2, 9)) - before
    assert pairs >= 3  # the turn's decode passes, each paired with the standard pass beside it
    assert "over" in render.width_text(prof, 4)  # shown with its spread
    assert page.facts.shape(key, lm, 4, measure=False) is not None


def test_the_status_line_says_decoding_once_the_prompt_is_read(tiny_registry, monkeypatch):
    """The status line of a streamed turn moves on from "reading the prompt" when the sides start decoding (it was
    drawn only with the first and the last update, so it said "reading the prompt" all through decoding)."""
    import app.page as page_mod
    from app.requests import TurnRequest
    from app.sessions import SessionRuns
    from app.ui import TURN_OUTPUTS

    monkeypatch.setattr(page_mod, "PANE_EVERY_S", 0.0)
    page = page_mod.Page(tiny_registry, SessionRuns(), preload=False)
    request = TurnRequest("Tell me a story.", [], "ConfAdapt", 0.9, 4, 3, 12, ("tiny", "none"))
    statuses = []
    for out, final, _, _ in page.generate_turn(request):
        status = dict(zip(TURN_OUTPUTS, out))["status"]
        if isinstance(status, str) and not final:
            statuses.append(status)
    assert "reading the prompt" in statuses[0]
    assert any("running standard vs" in s for s in statuses[1:]), statuses
    assert len(statuses) == 2  # drawn when it changes, not with every update
