"""The cost of a pass by tokens fed and the lossless layout chosen from it (model/engine/width.py)."""

from __future__ import annotations

import pytest

from model.engine.width import (
    choose_verify_layout,
    conditional_acceptance,
    cost_at,
    pass_costs,
    verify_rate,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLAT = {1: 0.030, 2: 0.030, 4: 0.031, 8: 0.032, 16: 0.034, 32: 0.040}  # a GPU at batch 1: width is nearly free
STEEP = {1: 0.030, 2: 0.060, 4: 0.120, 8: 0.240, 16: 0.480}  # cost grows with every token fed


def test_pass_costs_measures_every_width(tiny_lm):
    costs = pass_costs(tiny_lm, widths=(1, 4), repeats=2)
    assert set(costs) == {1, 4} and all(c > 0 for c in costs.values())


def test_cost_interpolates_and_extrapolates():
    assert cost_at(STEEP, 3) == pytest.approx(0.090)
    assert cost_at(STEEP, 32) == pytest.approx(0.960)
    assert cost_at(FLAT, 16) == 0.034


def test_conditional_acceptance():
    assert conditional_acceptance([0.6, 0.3, 0.15]) == pytest.approx([0.6, 0.5, 0.5])
    assert conditional_acceptance([0.5, None, None]) == pytest.approx([0.5, 0.0, 0.0])


@pytest.mark.parametrize("blocks", [None, (0, 1, 2, 3), (0, 3)])
def test_verify_rate_extremes(blocks):
    """Every draft accepted: k_max tokens per pass, whatever the layout (a block always follows all drafts);
    none accepted: one token per pass."""
    assert verify_rate(FLAT, [1.0, 1.0, 1.0], 4, blocks)[0] == pytest.approx(4.0)
    assert verify_rate(FLAT, [0.0, 0.0, 0.0], 4, blocks)[0] == pytest.approx(1.0)


def test_full_layout_never_stalls():
    """After a rejection the linear layout's next pass has no drafts; the full layout's always has some, so it
    keeps more tokens per pass at the same acceptance."""
    acc = conditional_acceptance([0.67, 0.42, 0.22])
    linear, full = verify_rate(FLAT, acc, 4)[0], verify_rate(FLAT, acc, 4, (0, 1, 2, 3))[0]
    assert linear == pytest.approx(1.736, abs=0.01)  # 2.31 in a pass with drafts, 1 in the pass after each stall
    assert full > linear + 0.4


def test_layout_follows_the_width_curve():
    acc = conditional_acceptance([0.67, 0.42, 0.22])
    k, blocks, speedup = choose_verify_layout(FLAT, acc, 8)
    assert k > 1 and blocks is not None and len(blocks) > 1 and speedup > 1.5  # width is free: a wide tree
    k, blocks, speedup = choose_verify_layout(STEEP, acc, 8)
    assert (k, blocks, speedup) == (1, None, 1.0)  # every token fed costs as much as a pass: standard decoding
