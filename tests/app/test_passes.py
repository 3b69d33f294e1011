"""The page's passes (app/passes.py): turns of several sessions that generate at once share forward passes, and
each answer is the same, bit for bit, as the turn run alone; a session alone runs one decoder per pass as
before; Stop of one touches nobody else; a failing pass ends its own turn only. Tiny random models with
SmolLM2's tokenizer on our CPU kernels, and the real default model (integration)."""

from __future__ import annotations

import threading

import pytest

from app.passes import PassScheduler
from app.requests import TurnRequest
from app.turn import prepare_turn, run_turn
from model.engine.kernel_forward import KernelForward

KEY = ("tiny", "none", "auto")
REQUESTS = [TurnRequest("Tell me a story.", [], "ConfAdapt", 0.5, 4, 3, 24, KEY),
            TurnRequest("Count to ten.", [], "lossless", 0.9, 4, 3, 20, KEY, "full tree"),
            TurnRequest("Name a colour.", [], "static k", 0.9, 4, 2, 16, KEY),
            TurnRequest("What is 2 plus 2?", [], "lossless", 0.9, 3, 3, 12, KEY, "linear")]


def _last(turn, passes, should_stop=lambda: None):
    last = None
    for last in run_turn(turn, should_stop, passes=passes):
        pass
    return last


def _records(state):
    return [(p.proposals, p.confidences, p.kept, p.verification and p.verification.drafts,
             p.verification and p.verification.checks) for side in (state.standard, state.mtp) for p in side.passes]


def _at_once(turns, passes, stops=None):
    """Run the turns in threads at once (as the page's workers do); their last states in order."""
    lasts = [None] * len(turns)
    go = threading.Barrier(len(turns))

    def one(i):
        go.wait()
        lasts[i] = _last(turns[i], passes, (stops or {}).get(i, lambda: None))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(turns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return lasts


@pytest.fixture
def kernel_registry(tiny_registry):
    if not isinstance(tiny_registry.get(*KEY).fast_engine(), KernelForward):
        pytest.skip("our CPU kernels are not built here: passes are not shared")
    return tiny_registry


def test_sessions_at_once_share_passes_and_answer_as_alone(kernel_registry):
    solo = [_last(prepare_turn(kernel_registry, r), PassScheduler()) for r in REQUESTS]
    assert all(p.shared_sequences == 1 for s in solo for side in (s.standard, s.mtp) for p in side.passes)
    passes = PassScheduler(gather_s=0.05)
    together = _at_once([prepare_turn(kernel_registry, r) for r in REQUESTS], passes)
    assert [s.phase for s in together] == ["done"] * 4
    for alone, shared in zip(solo, together):
        assert _records(shared) == _records(alone)  # bit for bit: tokens, proposals, confidences, drafts
        assert shared.standard.text == alone.standard.text and shared.mtp.text == alone.mtp.text
    widths = [p.shared_sequences for s in together for side in (s.standard, s.mtp) for p in side.passes]
    assert passes.shared_passes > 0 and max(widths) >= 2  # some passes carried several sessions
    for s in together:  # the two sides of one turn never share a pass, so each side's time is its own
        assert all(p.shared_rows >= p.fed_tokens for side in (s.standard, s.mtp) for p in side.passes)


def test_stop_of_one_session_touches_nobody_else(kernel_registry):
    solo = _last(prepare_turn(kernel_registry, REQUESTS[0]), PassScheduler())
    passes = PassScheduler(gather_s=0.05)
    turns = [prepare_turn(kernel_registry, r) for r in (REQUESTS[0], REQUESTS[1])]
    stopped = threading.Event()

    def stop_after_three():
        if len(turns[1].sides["standard"].passes) >= 3:
            stopped.set()
            return "stopped"
        return None

    a, b = _at_once(turns, passes, stops={1: stop_after_three})
    assert b.phase == "stopped" and len(b.standard.passes) == 3 and stopped.is_set()
    assert a.phase == "done" and _records(a) == _records(solo)


def test_a_failing_pass_ends_its_own_turn_only(kernel_registry):
    good = prepare_turn(kernel_registry, REQUESTS[2])
    bad = prepare_turn(kernel_registry, REQUESTS[3].with_(model_key=("nan", "none", "auto")))
    solo = _last(prepare_turn(kernel_registry, REQUESTS[2]), PassScheduler())
    a, b = _at_once([good, bad], PassScheduler(gather_s=0.05))
    assert b.phase == "error" and "NaN" in b.error and b.last == "standard"
    assert a.phase == "done" and _records(a) == _records(solo)


@pytest.mark.integration
def test_the_default_model_answers_the_same_beside_another_session(registry):
    reqs = [TurnRequest("What is 7 times 8?", [], "ConfAdapt", 0.9, 4, 3, 16),
            TurnRequest("Name three colours.", [], "lossless", 0.9, 4, 3, 16, (), "full tree")]
    if not isinstance(registry.get("smollm2-135m").fast_engine(), KernelForward):
        pytest.skip("our CPU kernels are not built here: passes are not shared")
    solo = [_last(prepare_turn(registry, r), PassScheduler()) for r in reqs]
    passes = PassScheduler(gather_s=0.05)
    together = _at_once([prepare_turn(registry, r) for r in reqs], passes)
    for alone, shared in zip(solo, together):
        assert shared.phase == "done" and _records(shared) == _records(alone)
    assert passes.shared_passes > 0


def test_the_pass_figure_and_table_say_when_a_pass_was_shared(kernel_registry):
    from app import figures, pass_table

    passes = PassScheduler(gather_s=0.05)
    together = _at_once([prepare_turn(kernel_registry, r) for r in REQUESTS[:2]], passes)
    state = together[0]
    shared = [p for p in state.mtp.passes if p.shared_sequences > 1]
    assert shared, "no MTP pass was shared"
    fig = figures.passes_figure(state.mtp.passes, state.strategy)
    titles = [f["layout"]["title"]["text"] for f in fig["frames"]]
    p = shared[0]
    assert f"shared by {p.shared_sequences} sessions, {p.shared_rows} rows</sup>" in titles[p.index]
    # on the title's smaller second line: the first stays as short as a phone's figure needs
    assert all(len(t.split("<br>")[0]) <= len("Pass 999 of 999: kept 32") for t in titles)
    alone = [t for t, q in zip(titles, state.mtp.passes) if q.shared_sequences == 1]
    assert all("shared" not in t for t in alone)
    table = pass_table.pass_table_html(state)
    assert f'title="shared by {p.shared_sequences} sessions, {p.shared_rows} rows">' in table
