"""The figures (app/figures.py): the pass figure, one frame per forward pass, its colours telling drafts
accepted, rejected and the model's own token apart and marking the mask block used (lossless), no tau line
when verifying; the trade-off figure of a checkpoint's sweep, the tau marker and the session's answers."""

from __future__ import annotations

import pytest
import torch

from app import figures, headline, tradeoff
from app.requests import TurnRequest
from app.turn import prepare_turn
from model.engine.decoding import generate
from model.engine.strategies import standard
from model.evaluation.sweep import AnswerPoint, Sweep, load_sweep
from tests.app.conftest import FP32, finish


@pytest.mark.integration
def test_lossless_turn_equals_standard_and_its_figure_marks_the_drafts(registry):
    """In float32 the lossless side's answer is standard decoding's to the bit."""
    prompt = "Write a Python function that returns the n-th Fibonacci number iteratively."
    last = finish(prepare_turn(registry, TurnRequest(prompt, [], "lossless", 0.9, 4, 3, 24, FP32)))[1]
    lm32 = registry.get(*FP32)
    assert lm32.dtype == torch.float32
    assert last.strategy.lossless and last.identical and last.mtp.text == generate(lm32, prompt, standard(), 24).text
    assert "identical answers: lossless" in headline.speed_html(last)
    fig = figures.passes_figure(last.mtp.passes, last.strategy)
    assert len(fig["frames"]) == last.mtp.forward_passes
    for rec, frame in zip(last.mtp.passes, fig["frames"]):
        colours = frame["data"][1]["marker"]["color"]
        check = rec.verification
        assert colours.count(figures.DRAFT_OK) == min(check.accepted, len(rec.kept))
        assert colours.count(figures.DRAFT_BAD) == (1 if check.correction is not None else 0)
        assert colours.count(figures.OWN) == (1 if len(rec.kept) > check.accepted else 0)
        labels, heights = frame["data"][1]["x"], frame["data"][1]["y"]
        assert [x.startswith("d") for x in labels[: rec.fed_drafts]] == [True] * rec.fed_drafts
        assert heights[: rec.fed_drafts] == check.confidences  # the model's confidence at each draft's place
        why = {"k_max": "every proposal kept", "draft rejected": "a draft was rejected",
               "max_new_tokens": "max new tokens reached", "utf-8": "the next proposal would split a character"}
        assert frame["layout"]["title"]["text"] == (f"Pass {rec.index + 1} of {len(fig['frames'])}: kept "
                                                     f"{len(rec.kept)}<br><sup>{why[rec.block_end]}</sup>")
    assert "shapes" not in fig["layout"] or not fig["layout"]["shapes"]  # no tau line when verifying
    checks = [r.verification for r in last.mtp.passes]
    assert any(c.correction is not None for c in checks) or any(c.accepted for c in checks)


def test_lossless_frames_show_every_mask_block_and_mark_the_one_used(tiny_registry):
    """A tree layout feeds a block of masks after several draft prefixes; the frame draws each block's proposals
    and marks the one that followed the accepted drafts (its proposals are the next pass's drafts)."""
    last = finish(prepare_turn(tiny_registry, TurnRequest("Count to ten.", [], "lossless", 0.9, 3, 3, 16, ("tiny", "none"),
                               "full tree")))[1]
    assert last.strategy.layout == "full" and last.identical
    fig = figures.passes_figure(last.mtp.passes, last.strategy)
    for rec, frame in zip(last.mtp.passes, fig["frames"]):
        bars = frame["data"][1]
        colours, hover = bars["marker"]["color"], bars["hovertext"]
        check = rec.verification
        used = 1 if check.next_drafts else 0
        assert colours.count(figures.NEW_DRAFT) == used * (last.strategy.k_max - 1)
        assert colours.count(figures.UNUSED_BLOCK) == (len(check.mask_blocks) - used) * (last.strategy.k_max - 1)
        shown = [h for h, c in zip(hover, colours) if c == figures.NEW_DRAFT]
        assert all("used: it followed the accepted drafts" in h for h in shown)
        if used:
            texts = [x.split(":", 1)[1] for x, c in zip(bars["x"], colours) if c == figures.NEW_DRAFT]
            assert texts == [figures._token_label(t) for t in check.block_texts[check.mask_blocks.index(
                check.accepted)]]
        patterns = bars["marker"]["pattern"]["shape"]
        assert [p == "/" for p in patterns] == [c == figures.UNUSED_BLOCK for c in colours]
    assert any(len(r.verification.mask_blocks) > 1 for r in last.mtp.passes)  # a tree, drawn as one


SWEEP = Sweep.from_dict({"model": "m", "n_prompts": 5, "max_new_tokens": 48, "points": [
    {"strategy": "standard", "name": "standard", "label": "standard", "tau": None, "k_max": 1, "effective_k": 1.0,
     "agreement_with_standard": 1.0, "nll_teacher": 0.40},
    {"strategy": "confadapt:0.5:4", "name": "confadapt", "label": "ConfAdapt tau=0.50 k_max=4", "tau": 0.5, "k_max": 4,
     "effective_k": 2.2, "agreement_with_standard": 0.2, "nll_teacher": 0.9},
    {"strategy": "confadapt:0.9:4", "name": "confadapt", "label": "ConfAdapt tau=0.90 k_max=4", "tau": 0.9, "k_max": 4,
     "effective_k": 1.4, "agreement_with_standard": 0.8, "nll_teacher": 0.5},
    {"strategy": "verify:4", "name": "verify", "label": "lossless verify k_max=4", "tau": None, "k_max": 4,
     "effective_k": 1.7, "agreement_with_standard": 1.0, "nll_teacher": 0.40, "acceptance_by_position": [0.6, 0.4, 0.2]},
]})


def test_a_frame_draws_its_pass_over_every_passs_bar_and_frames_grow_linearly():
    """The top row's bars (tokens kept by every pass) are drawn once; a frame sets only the bar of its pass, drawn
    over that one, its block and its title: the figure a turn re-renders on every update grows with its passes,
    not with their square (each frame drawing every bar up to its own made 283 passes a 1 MB figure)."""
    import json

    from model.engine.decoding import PassRecord
    from model.engine.strategies import confadapt

    def records(n):
        out = []
        for i in range(n):
            kept = 1 + i % 3
            out.append(PassRecord(index=i, fed_real=1, fed_masks=3, proposals=[5, 6, 7, 8],
                                  proposal_texts=["a", "b", "c", "d"], confidences=[0.9, 0.95, 0.92, 0.4],
                                  kept=[5, 6, 7][:kept], text="abc"[:kept], accepted=kept, seconds=0.01))
        return out

    recs = records(100)
    fig = figures.passes_figure(recs, confadapt(0.9, 4))
    top, now, block = fig["data"]
    assert top["x"] == list(range(1, 101)) and top["y"] == [len(r.kept) for r in recs]
    assert now["x"] == [100] and now["y"] == [len(recs[-1].kept)] and fig["layout"]["barmode"] == "overlay"
    assert block["xaxis"] == "x2" and block["x"] == ["1:a", "2:b", "3:c", "4:d"]
    # tau: a dashed line at 0.9 across the bottom row, named in that row's title, not written over its last bar
    (line,) = fig["layout"]["shapes"]
    assert line["y0"] == line["y1"] == 0.9 and line["line"]["dash"] == "dash"
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles == ["Tokens kept per forward pass", "This pass: proposals (dashed: tau 0.90)"]
    for rec, frame in zip(recs, fig["frames"]):
        assert frame["traces"] == [1, 2]
        assert frame["data"][0]["x"] == [rec.index + 1] and frame["data"][0]["y"] == [len(rec.kept)]
        assert frame["data"][1]["marker"]["color"].count(figures.KEPT) == len(rec.kept) - 1
    size = len(json.dumps(fig))
    assert len(json.dumps(figures.passes_figure(records(400), confadapt(0.9, 4)))) < 5 * size  # 4x the passes
    # while the answer streams: the same last pass, no frames and no controls to play them
    still = figures.passes_figure(recs, confadapt(0.9, 4), animate=False)
    assert still["data"] == fig["data"] and still["frames"] == [] and len(json.dumps(still)) < size / 10
    assert not still["layout"].get("sliders") and not still["layout"].get("updatemenus")


def test_the_pass_figure_reaches_the_page_as_json_into_one_graph():
    """The pass figure's component value is JSON text holding the caption, the frame count and Plotly's figure,
    frames included; its template never changes with the value (Gradio re-renders a template whose text changed,
    which would wipe the graph Plotly drew in it), and its script draws with ``Plotly.react``."""
    import json

    from model.engine.decoding import PassRecord
    from model.engine.strategies import confadapt

    recs = [PassRecord(index=i, fed_real=1, fed_masks=1, proposals=[5, 6], proposal_texts=["a", "b"],
                       confidences=[0.5, 0.95], kept=[5, 6], text="ab", accepted=2, seconds=0.01) for i in range(3)]
    fig = figures.passes_figure(recs, confadapt(0.9, 2))
    value = json.loads(figures.figure_json(fig, '<p class="mtp-fig-caption">a & b</p>'))
    assert value["caption"] == '<p class="mtp-fig-caption">a & b</p>' and value["frames"] == 3
    assert [f["name"] for f in value["figure"]["frames"]] == ["0", "1", "2"]
    assert value["figure"]["data"][0]["y"] == [2, 2, 2] and value["figure"]["layout"]["sliders"]
    assert "${" not in figures.PLOT_TEMPLATE and "{{" not in figures.PLOT_TEMPLATE
    assert "Plotly.react" in figures.PLOT_JS and figures.PLOTLY_JS_URL in figures.PLOT_HEAD
    assert figures.PLOTLY_JS.is_file()


def test_empty_figures_have_no_axis_below_zero():
    """Before the first pass the figures draw the axes a pass will have: nothing below zero."""
    from model.engine.strategies import confadapt

    fig = figures.passes_figure([], confadapt(0.9, 4))
    lay = fig["layout"]
    assert lay["xaxis"]["range"][0] > 0 and lay["yaxis"]["range"] == [0, 4.5] and lay["yaxis2"]["range"] == [0, 1.05]
    assert fig["frames"] == []
    race = figures.race_figure([("standard", []), ("ConfAdapt", [])])
    assert race.layout.xaxis.rangemode == race.layout.yaxis.rangemode == "nonnegative"


def test_tau_point_interpolates_along_the_confadapt_curve():
    p = tradeoff.tau_point(SWEEP, 0.7, 4)
    assert p["inside"] and p["effective_k"] == pytest.approx(1.8) and p["agreement_with_standard"] == pytest.approx(0.5)
    assert p["nll_teacher"] == pytest.approx(0.7)
    assert tradeoff.tau_point(SWEEP, 0.9)["effective_k"] == pytest.approx(1.4)
    out = tradeoff.tau_point(SWEEP, 0.99)
    assert not out["inside"] and out["effective_k"] == pytest.approx(1.4)  # the nearest end, said so
    assert tradeoff.tau_point(SWEEP, None) is None and tradeoff.tau_point(None, 0.9) is None
    assert tradeoff.tau_point(SWEEP, "abc") is None


def test_tradeoff_figure_labels_taus_marks_lossless_tau_and_the_sessions_answers():
    key = ("m", "none", "auto")
    answers = [AnswerPoint(key, 1, "ConfAdapt tau=0.90 k_max=4", "confadapt", 0.9, 1.3, True, None, 0.4, 0.4),
               AnswerPoint(key, 2, "static k=3", "static", None, 3.0, False, 4, 1.2, 0.4, repeats=True)]
    fig = tradeoff.tradeoff_figure(SWEEP, tau=0.7, k_max=4, answers=answers, source="shipped")
    by_name = {}
    for t in fig.data:
        by_name.setdefault(t.name, []).append(t)
    curve_top, curve_bottom = by_name["ConfAdapt k_max=4 (tau)"]
    assert list(curve_top.text) == ["0.9", "0.5"] and list(curve_top.y) == [0.8, 0.2]
    assert list(curve_bottom.y) == [0.5, 0.9] and curve_bottom.xaxis == "x2"
    lossless = by_name["lossless"][0]
    assert lossless.marker.symbol == "diamond" and list(lossless.x) == [1.7] and "k_max 4" in lossless.text[0]
    star = by_name["tau 0.7 now"][0]
    assert star.marker.symbol == "star" and list(star.x) == [pytest.approx(1.8)]
    same, parted = by_name["your answers: identical"][0], by_name["your answers: diverged"][0]
    assert list(same.y) == [1.0] and list(parted.y) == [0.0] and list(by_name["your answers: diverged"][1].y) == [1.2]
    assert "diverges at token 5" in parted.hovertext[0] and "repetition" in parted.hovertext[0]
    assert "shipped with the checkpoint" in fig.layout.title.text
    empty = tradeoff.tradeoff_figure(None, tau=0.9)
    assert "no measured trade-off" in empty.layout.title.text
    assert any("Measure the trade-off" in a.text for a in empty.layout.annotations)
    assert "tau 0.9 now" not in {t.name for t in empty.data}


def test_tradeoff_labels_at_one_place_are_one_label_and_right_hand_labels_go_left():
    """v4's shipped sweep (kept in tests/data): tau 0.5 and 0.7 sit at nearly the same point (effective k 2.389
    and 2.392, both 0% identical): one label "0.5, 0.7"; labels right of the middle sit left of their point
    ("k_max 4 full" was clipped at 390 px; the browser test checks the drawn boxes)."""
    from tests.conftest import ROOT

    sweep = load_sweep(ROOT / "tests" / "data" / "sweep_v4")
    fig = tradeoff.tradeoff_figure(sweep, tau=0.9, k_max=4)
    curve = next(t for t in fig.data if t.name == "ConfAdapt k_max=4 (tau)")
    assert list(curve.text) == ["0.99", "0.9", "0.5, 0.7", ""]
    lossless = next(t for t in fig.data if t.name == "lossless" and t.text is not None)
    assert list(lossless.text) == ["k_max 4", "k_max 4 full"] and list(lossless.textposition) == ["top left"] * 2
    assert list(curve.textposition)[:2] == ["top right", "top right"]


def test_every_block_end_has_a_short_form_and_words():
    """The per-pass table and the pass figure name every reason a block can end, in short and in words."""
    from app.pass_table import BLOCK_END_SHORT, BLOCK_END_WORDS
    from model.engine.records import BLOCK_ENDS

    assert set(BLOCK_END_SHORT) == set(BLOCK_ENDS)
    assert set(BLOCK_END_WORDS) == set(BLOCK_ENDS)
