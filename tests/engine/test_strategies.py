"""The strategy vocabulary (model/engine/strategies.py): the constructors' checks, the spec grammar
and defaults of ``resolve_strategy``, ``parse_strategies`` (the evaluation CLIs' lists)."""

from __future__ import annotations

import pytest

from model.engine.strategies import confadapt, parse_strategies, resolve_strategy, standard, static_k
from model.evaluation.gsm8k import STEP_BY_STEP, make_prompt


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: confadapt(1.5, 16), "tau must be in"),
        (lambda: confadapt(-0.1, 16), "tau must be in"),
        (lambda: confadapt(float("nan"), 16), "tau must be in"),
        (lambda: confadapt(0.9, 0), "k_max must be"),
        (lambda: resolve_strategy("static", k=4, k_max=3), "cannot exceed k_max"),
        (lambda: static_k(0), "k must be"),
        (lambda: resolve_strategy("beam"), "Unknown strategy"),
        (lambda: resolve_strategy("confadapt:x"), "Bad strategy"),
        (lambda: resolve_strategy("confadapt", k_max=33, cap=32), "k_max must be from 1 to 32"),
        (lambda: resolve_strategy("static:40", cap=32), "k must be from 1 to 32"),
    ],
)
def test_bad_strategy_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_resolve_strategy_round_trips_and_defaults():
    for spec in ["standard", "static:3", "confadapt:0.9:16", "confadapt:0.75:8", "verify:4"]:
        assert resolve_strategy(spec).spec == spec
    assert resolve_strategy("confadapt:0.9") == confadapt(0.9, 16)
    # a spec's own values win; what it leaves out comes from the arguments, then the model's default
    assert resolve_strategy("confadapt:0.7", default_k_max=4) == resolve_strategy("confadapt", tau=0.7, default_k_max=4)
    assert resolve_strategy("confadapt:0.7", default_k_max=4).k_max == 4
    assert resolve_strategy("confadapt:0.7:8", k_max=2) == confadapt(0.7, 8)
    assert resolve_strategy("verify:8") == resolve_strategy("verify", k_max=8)
    assert resolve_strategy("static:2") == resolve_strategy("static", k=2) == static_k(2)
    assert resolve_strategy(" Standard ") == standard()
    # the caller's cap bounds the model's default too
    assert resolve_strategy("verify", default_k_max=64, cap=32).k_max == 32


def test_parse_strategies_and_prompt():
    ss = parse_strategies("standard, static:2,confadapt:0.9,static:2")
    assert [s.spec for s in ss] == ["standard", "static:2", "confadapt:0.9:16"]
    with pytest.raises(ValueError, match="Bad strategy"):
        parse_strategies("static:x")
    with pytest.raises(ValueError, match="No strategies"):
        parse_strategies(" , ")
    assert make_prompt(" Q? ") == "Q?"
    assert make_prompt("Q?", step_by_step=True) == f"Q?\n{STEP_BY_STEP}"


def test_confadapt_run_starts_at_the_first_proposal():
    """Paper 4.5 (and the authors' SGLang code): the leading run with confidence >= tau counts from the first
    proposal, and at least that one is kept."""
    ca = confadapt(0.9, 4)
    assert ca.accept([0.95, 0.99, 0.97, 0.5]) == (3, "below tau")
    assert ca.accept([0.95, 0.99, 0.97, 0.9]) == (4, "k_max")
    assert ca.accept([0.8, 0.99, 0.99, 0.99]) == (1, "below tau")  # unsure of the next token: one token
    assert ca.accept([0.95, 0.5, 0.99, 0.99]) == (1, "below tau")
    assert ca.accept([0.1]) == (1, "k_max")
    assert confadapt(0.0, 4).accept([0.0, 0.0, 0.0, 0.0]) == (4, "k_max")
