"""The pass figure (app/figures.py): one frame per forward pass, its colours telling drafts accepted,
rejected and the model's own token apart (lossless), no tau line when verifying."""

from __future__ import annotations

import pytest
import torch

from app import figures, render
from app.runner import prepare_turn
from model.engine.decoding import generate
from model.engine.strategies import standard
from tests.app.conftest import FP32, finish


@pytest.mark.integration
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
