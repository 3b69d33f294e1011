"""The speed/quality sweep (model/evaluation/sweep.py): the typed Sweep, SweepPoint and AnswerPoint, the
sweep.json format they keep, and a sweep measured on a tiny model."""

from __future__ import annotations

import json
import logging
import pickle

import pytest

from model.engine.strategies import ConfAdapt, Verify, confadapt, standard, verify
from model.evaluation.sweep import (SWEEP_FILE, AnswerPoint, Sweep, SweepPoint, load_sweep, run_sweep,
                                    verify_acceptance, write_sweep)
from tests.conftest import ROOT

SHIPPED = ROOT / "assets" / "smollm2-135m-mtp"


def test_the_shipped_sweep_loads_parsed_and_keeps_its_file_format(tmp_path):
    raw = json.loads((SHIPPED / SWEEP_FILE).read_text())
    sweep = load_sweep(SHIPPED)
    assert sweep == Sweep.from_dict(raw) and sweep.to_dict() == raw  # the file format, key for key
    assert (sweep.model, sweep.n_prompts, sweep.max_new_tokens, sweep.dtype) == ("smollm2-135m", 10, 128, "bfloat16")
    assert sweep.data == "assets/gsm8k_test_sample.jsonl + assets/general_prompts_heldout.jsonl (first 5 each)"
    assert [p.spec for p in sweep.points] == ["standard", "confadapt:0.5:4", "confadapt:0.7:4", "confadapt:0.9:4",
                                              "confadapt:0.99:4", "verify:4", "verify:4:full"]
    linear, full = sweep.named("verify")
    assert linear.strategy == Verify(k_max=4) and (linear.layout, linear.linear_verify) == ("linear", True)
    assert full.strategy == verify(4, "full") and (full.layout, full.linear_verify) == ("full", False)
    assert full.label == "lossless verify k_max=4, full tree" and full.acceptance_by_position == (
        0.6256684491978609, 0.3924731182795699, 0.2118491921005386)
    ca = sweep.named("confadapt")
    assert [p.tau for p in ca] == [0.5, 0.7, 0.9, 0.99] and {p.k_max for p in ca} == {4}
    assert all(isinstance(p.strategy, ConfAdapt) and p.layout is None and not p.linear_verify for p in ca)
    assert sweep.points[0].strategy == standard() and sweep.points[0].k is None
    # written back, the same JSON
    write_sweep(sweep, tmp_path / "copy" / SWEEP_FILE)
    assert json.loads((tmp_path / "copy" / SWEEP_FILE).read_text()) == raw
    assert load_sweep(tmp_path / "copy") == sweep and pickle.loads(pickle.dumps(sweep)) == sweep


def test_verify_acceptance_is_the_linear_lossless_point_at_that_k_max():
    sweep = load_sweep(SHIPPED)
    assert verify_acceptance(sweep, 4) == [0.6847290640394089, 0.40594059405940597, 0.2263681592039801]
    assert verify_acceptance(sweep, 8) is None and verify_acceptance(None, 4) is None
    only_full = Sweep(None, None, None, None, None, (SweepPoint(verify(4, "full"), 1.5,
                                                                acceptance_by_position=(0.9, 0.5, 0.1)),))
    assert verify_acceptance(only_full, 4) is None  # the full tree's acceptance is not the linear layout's
    unmeasured = Sweep(None, None, None, None, None, (SweepPoint(verify(4), 1.0),))
    assert verify_acceptance(unmeasured, 4) is None


def test_a_point_keeps_tau_whole_though_its_spec_rounds_it():
    point = SweepPoint(confadapt(0.1234567, 4), 1.5, 0.5, 0.8)
    d = point.to_dict()
    assert d["strategy"] == "confadapt:0.123457:4" and d["tau"] == 0.1234567
    assert SweepPoint.from_dict(d) == point and SweepPoint.from_dict(d).tau == 0.1234567
    assert SweepPoint.from_dict(dict(d, tau=None)).tau == 0.123457  # no tau field: the spec's


@pytest.mark.parametrize("point, message", [
    ({"effective_k": 1.0}, "needs its 'strategy' spec"),
    ({"strategy": "sometimes", "effective_k": 1.0}, "Unknown strategy 'sometimes'"),
    ({"strategy": "verify:4"}, "needs 'effective_k'"),
    ({"strategy": "verify:4", "effective_k": "fast"}, "'effective_k' must be a finite number"),
    ({"strategy": "verify:4", "k_max": 3, "effective_k": 1.0}, "k_max 3 disagrees with the spec"),
    ({"strategy": "verify:4", "name": "confadapt", "effective_k": 1.0}, "name 'confadapt' disagrees"),
    ({"strategy": "confadapt:0.5:4", "tau": 0.6, "effective_k": 1.0}, "tau 0.6 disagrees with the spec"),
    ({"strategy": "standard", "tau": 0.5, "effective_k": 1.0}, "tau 0.5 disagrees with the spec"),
    ({"strategy": "verify:4", "effective_k": 1.0, "acceptance_by_position": 0.5}, "must be a list"),
    ("verify:4", "A sweep point is a mapping"),
])
def test_a_bad_point_is_refused_with_its_reason(point, message):
    with pytest.raises(ValueError, match=message):
        SweepPoint.from_dict(point)


def test_a_bad_sweep_file_reads_as_none_and_says_why(tmp_path, caplog):
    assert load_sweep(None) is None and load_sweep(tmp_path / "nowhere") is None
    with pytest.raises(ValueError, match="list of 'points'"):
        Sweep.from_dict({"model": "m"})
    with pytest.raises(ValueError, match="'n_prompts' must be a whole number"):
        Sweep.from_dict({"n_prompts": 2.5, "points": []})
    for i, text in enumerate(["{not json", json.dumps({"points": [{"strategy": "verify:4"}]})]):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / SWEEP_FILE).write_text(text)
        with caplog.at_level(logging.WARNING, logger="model.evaluation.sweep"):
            assert load_sweep(tmp_path / str(i)) is None
        assert f"{i}/{SWEEP_FILE}: not a sweep" in caplog.text
    with pytest.raises(ValueError):  # strict JSON: no NaN in the file
        write_sweep(Sweep(None, None, None, None, None, (SweepPoint(standard(), 1.0, nll_teacher=float("nan")),)),
                    tmp_path / "nan.json")


def test_answer_points_are_plain_values_both_ways():
    point = AnswerPoint(("smollm2-135m", "none", "auto"), 2, "ConfAdapt tau=0.90 k_max=4", "confadapt", 0.9, 1.8,
                        False, 6, 0.7, 0.4, True)
    d = point.to_dict()
    assert d == {"model_key": ["smollm2-135m", "none", "auto"], "turn": 2, "label": "ConfAdapt tau=0.90 k_max=4",
                 "name": "confadapt", "tau": 0.9, "effective_k": 1.8, "identical": False, "parted_at": 6,
                 "nll": 0.7, "standard_nll": 0.4, "repeats": True, "sampled": False}
    assert AnswerPoint.from_dict(d) == point and AnswerPoint.from_dict(json.loads(json.dumps(d))) == point
    assert pickle.loads(pickle.dumps(point)) == point  # what a ZeroGPU worker sends back
    short = AnswerPoint.from_dict({"model_key": ["m"], "turn": 1, "label": "standard", "name": "standard",
                                   "effective_k": 1, "identical": True})
    assert (short.tau, short.parted_at, short.nll, short.standard_nll, short.repeats) == (None, None, None, None, False)
    assert short.effective_k == 1.0 and isinstance(short.effective_k, float)
    with pytest.raises(ValueError, match="needs 'turn', 'identical'"):
        AnswerPoint.from_dict({"model_key": ["m"], "label": "x", "name": "standard", "effective_k": 1.0})
    with pytest.raises(ValueError, match="'model_key' must be a list of strings"):
        AnswerPoint.from_dict(dict(d, model_key="smollm2-135m"))


def test_run_sweep_measures_standard_first_and_every_strategy_on_every_prompt(tiny_lm, tmp_path):
    seen = []
    sweep = run_sweep(tiny_lm, ["hi", "Name a colour."], [confadapt(0.5, 4), standard(), verify(4)],
                      max_new_tokens=6, on_progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 6) for i in range(1, 7)]  # 2 prompts x (standard + ConfAdapt + lossless)
    assert (sweep.model, sweep.data, sweep.n_prompts, sweep.max_new_tokens, sweep.dtype) == (
        "tiny-llama", "prompts", 2, 6, "float32")
    std, ca, lossless = sweep.points
    assert [p.strategy for p in sweep.points] == [standard(), confadapt(0.5, 4), verify(4)]
    assert (std.effective_k, std.agreement_with_standard) == (1.0, 1.0)
    assert lossless.agreement_with_standard == 1.0  # lossless: both answers are standard decoding's
    assert ca.effective_k >= 1.0 and lossless.effective_k >= 1.0
    assert all(p.accuracy is None and p.nll_teacher is not None and p.nll_teacher > 0 for p in sweep.points)
    assert std.acceptance_by_position is None and ca.acceptance_by_position is None
    assert 1 <= len(lossless.acceptance_by_position) <= 3
    assert all(0.0 <= a <= 1.0 for a in lossless.acceptance_by_position)
    assert 0.0 <= lossless.draft_acceptance_rate <= 1.0
    write_sweep(sweep, tmp_path / SWEEP_FILE)
    assert load_sweep(tmp_path) == sweep and pickle.loads(pickle.dumps(sweep)) == sweep
