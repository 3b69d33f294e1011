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


# ----------------------------------------------------------------------------- robust costs and verify:auto
def test_width_costs_are_ratios_of_paired_passes_and_survive_load():
    """Each round's wide pass over that round's one-token pass: a round run under 3x load gives the same ratio, so
    the medians hold still where absolute times do not; observations refresh them, spread and counts are told."""
    from model.engine.width import WidthCosts

    rounds = {1: [0.010, 0.030, 0.010, 0.011], 4: [0.013, 0.039, 0.0131, 0.0142], 16: [0.02, 0.06, 0.02, 0.022]}
    wc = WidthCosts.from_rounds(rounds)
    assert wc.ratio(4) == pytest.approx(1.3, abs=0.01) and wc.ratio(16) == pytest.approx(2.0, abs=0.01)
    assert wc.ratio(1) == 1.0 and wc.count(4) == 4 and wc.ratio(10) == pytest.approx(1.65, abs=0.01)
    lo, hi = wc.spread(4)
    assert lo <= wc.ratio(4) <= hi
    for _ in range(100):  # the page's own passes: the window keeps the last 64
        wc.observe(4, 1.1)
    assert wc.ratio(4) == pytest.approx(1.1) and wc.count(4) == WidthCosts.WINDOW
    assert WidthCosts.from_dict(wc.to_dict()).costs() == wc.costs()


def test_auto_width_narrows_as_the_pass_fills():
    """Alone on a flat width curve verify:auto takes a wide layout; beside many rows on a curve that grows past 8
    rows, the marginal cost of more rows wins and it narrows down to standard decoding."""
    from model.engine.width import AutoWidth, WidthCosts

    flat = WidthCosts({2: [1.02], 4: [1.05], 8: [1.1], 16: [1.2], 32: [1.5], 64: [2.2]})
    steep = WidthCosts({2: [1.05], 4: [1.15], 8: [1.4], 16: [2.6], 32: [5.0], 64: [9.8]})
    acc = (0.7, 0.5, 0.3)
    assert AutoWidth(flat, acc).choose(4)[0] == 4
    k_alone, _ = AutoWidth(steep, acc).choose(4, 0)
    k_busy, _ = AutoWidth(steep, acc).choose(4, 48, other_tokens=40)  # 48 rows of others, emitting 40 tokens
    assert k_alone >= 2 and k_busy < k_alone
    assert AutoWidth(steep, (0.05, 0.0, 0.0)).choose(4, 48, other_tokens=40) == (1, None)  # no draft pays
    assert AutoWidth(steep, acc).choose(4, 48)[0] == 4  # others that emit nothing: the pass costs what it costs
    policy = AutoWidth(flat, acc)
    assert policy.acceptance_for([1.0, 1.0, 1.0], 0) == [0.7, 0.5, 0.3]  # the prior until passes are seen
    assert policy.acceptance_for([1.0, 1.0, 1.0], 1000)[0] > 0.95


@pytest.mark.parametrize("curve", ["flat", "steep"])
def test_verify_auto_equals_standard_alone_and_shared(base_tokenizer, curve):
    """Whatever layout it picks pass by pass (wide trees on a flat curve, narrow or none beside rows on a steep
    one), verify:auto's tokens are standard decoding's: alone (float64, torch path) and in shared passes with
    other sequences (float32, our kernels, rows exact)."""
    import copy

    import torch

    from model.engine import kernels as K
    from model.engine.batch import BatchRunner
    from model.engine.decoding import Decoder, run
    from model.engine.loading import wrap_model
    from model.engine.strategies import resolve_strategy, standard
    from model.engine.width import AutoWidth, WidthCosts
    from tests.conftest import make_tiny

    costs = {"flat": WidthCosts({2: [1.0], 8: [1.05], 64: [1.3]}),
             "steep": WidthCosts({2: [1.1], 4: [1.5], 8: [3.0], 64: [30.0]})}[curve]
    policy = AutoWidth(costs, (0.6, 0.4, 0.2))
    auto = resolve_strategy("verify:auto:4")
    tok = copy.deepcopy(base_tokenizer)
    lm64 = wrap_model(make_tiny(tok, dtype=torch.float64), tok, source="tiny64")
    for prompt in ("Hi", "Tell me a story about a cat."):
        ids = lm64.prompt_ids(prompt)
        dec = Decoder(lm64, ids, auto, 16, width=policy)
        recs = list(dec)
        assert dec.generated == run(lm64, ids, standard(), 16).token_ids
        widths = {r.fed_tokens for r in recs[1:]}
        assert (max(widths) >= 4) if curve == "flat" else True
    if K.choose_isa("auto") is None:
        return
    lm = wrap_model(make_tiny(copy.deepcopy(base_tokenizer)), copy.deepcopy(base_tokenizer), source="tiny")
    prompts = ["Hi", "Tell me a story about a cat.", "Why is the sky blue?", "Name three colours."]
    decs = [Decoder(lm, lm.prompt_ids(p), auto if i % 2 else standard(), 12, width=policy)
            for i, p in enumerate(prompts)]
    runner = BatchRunner(lm)
    for d in decs:
        runner.add(d)
    runner.run()
    for d, p in zip(decs, prompts):
        assert d.generated == run(lm, lm.prompt_ids(p), standard(), 12).token_ids
