"""Accuracy against effective k (model/evaluation/accuracy.py): the report on tiny random models, the
adapter-off reference, the Pareto figure."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch

from model.engine.decoding import Decoder
from model.engine.strategies import confadapt, standard, static_k
from model.evaluation.accuracy import evaluate, pareto_figure, rescore, write_figure
from model.evaluation.gsm8k import load_problems, make_prompt
from tests.conftest import ACCURACY_FIELDS, GSM8K_PROBLEMS, write_jsonl


def test_evaluate_on_tiny_model(tiny_lm, tmp_path):
    probs = load_problems(write_jsonl(tmp_path / "d.jsonl", GSM8K_PROBLEMS))
    rep = evaluate(tiny_lm, probs, [static_k(2), confadapt(0.0, 4)], max_new_tokens=8, progress=False)
    specs = [r["strategy"] for r in rep["strategies"]]
    assert specs == ["standard", "static:2", "confadapt:0:4"]  # standard added first as the reference
    assert rep["base_standard"] is None and rep["config"]["complete"] and rep["config"]["n_problems"] == 2
    by = {r["strategy"]: r for r in rep["strategies"]}
    for r in by.values():
        assert ACCURACY_FIELDS <= set(r) and r["n"] == 2
        assert r["accuracy"] in (0.0, 0.5, 1.0)
        assert r["accuracy_stderr"] == pytest.approx(math.sqrt(r["accuracy"] * (1 - r["accuracy"]) / 2))
        assert r["nll_teacher"] > 0 and r["tokens_per_second"] > 0
    std = by["standard"]
    assert std["effective_k_mean"] == 1.0 and std["effective_k_std"] == 0.0
    assert std["agreement_with_standard"] == 1.0 == std["agreement_with_base"]
    # tau = 0 keeps all 4 proposals of every pass: 8 tokens in 2 passes per problem (unless a stop token)
    rows = rep["problems"]
    ca = [row["results"]["confadapt:0:4"] for row in rows]
    kept = [k for rec in ca for k in rec["kept_per_pass"]]
    assert by["confadapt:0:4"]["effective_k_mean"] == pytest.approx(sum(kept) / len(kept))
    assert by["confadapt:0:4"]["forward_passes"] == len(kept)
    # per-problem records hold the inspection fields, consistent with the summary
    for row in rows:
        assert row["gold"] in ("5", "12") and set(row["results"]) == set(specs)
        for rec in row["results"].values():
            assert rec["correct"] == (rec["extracted"] == row["gold"])
            assert rec["same_as_standard"] == (rec["text"] == row["results"]["standard"]["text"])
    agree = sum(row["results"]["static:2"]["same_as_standard"] for row in rows) / 2
    assert by["static:2"]["agreement_with_standard"] == agree
    json.dumps(rep)  # JSON-ready
    # re-extracting the saved answers with the same extractor changes nothing
    assert rescore(json.loads(json.dumps(rep)))["strategies"] == json.loads(json.dumps(rep["strategies"]))


def test_evaluate_with_adapter_compares_with_base(tiny_lm, tmp_path):
    """With a LoRA adapter, the teacher and the 'base' reference run with the adapter off."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(tiny_lm.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"],
                                                          init_lora_weights=False))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(50.0)  # make the adapter change the greedy tokens
    lm = dataclasses.replace(tiny_lm, model=peft_model.eval(), adapter="lora")
    probs = load_problems(write_jsonl(tmp_path / "d.jsonl", GSM8K_PROBLEMS))
    rep = evaluate(lm, probs, [standard()], max_new_tokens=6, progress=False)
    base = rep["base_standard"]
    assert base is not None and base["n"] == 2 and rep["config"]["teacher"] == "base model, adapter off"
    # the base run is plain standard decoding of the model with the adapter disabled
    ids = lm.prompt_ids(make_prompt(GSM8K_PROBLEMS[0]["question"]))
    with peft_model.disable_adapter():
        ref = Decoder(dataclasses.replace(lm, adapter=None), ids, standard(), 6)
        for _ in ref:
            pass
    row = rep["problems"][0]
    assert row["base_standard"]["text"] == ref.result().text
    # teacher NLL of the base's own greedy answer is -sum log(confidence) of that run
    expected = -sum(math.log(p.confidences[0]) for p in ref.passes) / len(ref.generated)
    assert row["base_standard"]["nll_teacher"] == pytest.approx(expected, rel=1e-4)
    std = row["results"]["standard"]
    assert std["same_as_base"] == (std["text"] == ref.result().text)
    assert std["text"] != ref.result().text  # the adapter changed the answer


def test_pareto_figure_and_files(tmp_path):
    def row(spec, name, k, acc, tau=None, k_max=1):
        return {"strategy": spec, "label": spec, "name": name, "k": k, "tau": tau, "k_max": k_max, "accuracy": acc,
                "accuracy_stderr": 0.05, "effective_k_mean": k}
    rep = {"config": {"model": "m", "n_problems": 3, "max_new_tokens": 8},
           "strategies": [row("standard", "standard", 1.0, 0.4), row("static:2", "static", 2.0, 0.2, k_max=2),
                          row("confadapt:0.7:16", "confadapt", 1.8, 0.3, 0.7, 16),
                          row("confadapt:0.9:16", "confadapt", 1.2, 0.38, 0.9, 16)]}
    fig = pareto_figure(rep)
    names = [t.name for t in fig.data]
    assert names == ["standard", "static:2", "ConfAdapt k_max=16 (tau)"]
    line = fig.data[2]
    assert list(line.x) == [1.2, 1.8] and list(line.text) == ["tau=0.9", "tau=0.7"] and "lines" in line.mode
    paths = write_figure(rep, tmp_path / "r.json")
    assert Path(paths["html"]).stat().st_size > 100_000
    if paths["png"] is None:
        assert "BROWSER_PATH" in paths["png_error"]
    else:
        assert Path(paths["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_export_that_never_answers_is_stopped(tmp_path, monkeypatch):
    """A browser that starts and never answers (here a script that only sleeps) costs png_timeout_s, not the
    run: the only bounded wait on the export is png_timeout_s, it runs out, the export is killed and then
    reaped; the HTML is written, the PNG is reported missing with the reason, and the browser is killed."""
    import model.evaluation.accuracy as accuracy

    hang = tmp_path / "browser"
    hang.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\nexec sleep 600\n")
    hang.chmod(0o755)
    monkeypatch.setenv("BROWSER_PATH", str(hang))
    waits = []  # the timeout of every wait on the export's child process, in order

    class RecordingPopen(subprocess.Popen):
        def communicate(self, input=None, timeout=None):
            waits.append(timeout)
            return super().communicate(input, timeout)

    monkeypatch.setattr(accuracy.subprocess, "Popen", RecordingPopen)
    rep = {"config": {"model": "m", "n_problems": 1, "max_new_tokens": 8},
           "strategies": [{"strategy": "standard", "label": "standard", "name": "standard", "k": 1.0, "tau": None,
                           "k_max": 1, "accuracy": 0.5, "accuracy_stderr": 0.5, "effective_k_mean": 1.0}]}
    paths = write_figure(rep, tmp_path / "r.json", png_timeout_s=8)
    # one wait bounded by png_timeout_s that ran out, then one that reaps the killed child (no second timeout)
    assert waits == [8, None]
    assert Path(paths["html"]).exists() and paths["png"] is None
    assert "no image after 8 s" in paths["png_error"]
    assert "BROWSER_PATH" in paths["png_error"] and "The HTML figure was written" in paths["png_error"]
    pid_file = tmp_path / "pid"
    if pid_file.exists():  # kaleido got as far as starting the browser: it must be gone now
        pid = int(pid_file.read_text())
        time.sleep(0.5)
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_draft_metrics_keep_the_counts_and_tables_show_few_checks_as_counts():
    """Acceptance by draft position comes with its counts: a position checked twice reads "0 of 2", not a 0.00 that
    looks measured; a report written before the counts were kept still shows its shares."""
    from model.evaluation.accuracy_report import by_position_cell, draft_metrics

    m = draft_metrics([(1, 1)] * 9 + [(1, 0)] * 3 + [(2, 1), (2, 1)])  # (proposed, accepted) per pass
    assert m["drafts_checked_by_position"] == [14, 2] and m["drafts_accepted_by_position"] == [11, 0]
    assert m["acceptance_by_position"] == [11 / 14, 0.0] and m["draft_acceptance_rate"] == 11 / 16
    assert by_position_cell(m) == "0.79 / 0 of 2"
    assert by_position_cell({"acceptance_by_position": [0.5, 0.25]}) == "0.50 / 0.25"
    assert draft_metrics([]) == {}
