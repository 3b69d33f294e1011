"""Evaluation: answer extraction, scoring on tiny random models, the CLI on the real SmolLM2."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from model.evaluation.gsm8k import extract_answer, extract_gold, is_correct, normalize_number
from model.engine.decoding import Decoder
from model.engine.strategies import confadapt, standard, static_k
from model.engine.scoring import teacher_nll
from model.engine.strategies import parse_strategies
from model.evaluate import main
from model.evaluation.accuracy import evaluate, pareto_figure, rescore, write_figure
from model.evaluation.gsm8k import STEP_BY_STEP, load_problems, make_prompt
from tests.conftest import GSM8K_SAMPLE

# --------------------------------------------------------------------------- extractor
# Outputs of SmolLM2-135M-Instruct (greedy, chat format, GSM8K test questions 1-10; tails kept),
# with the number a reader takes as the model's final answer.
REAL_OUTPUTS = [
    # cut off by max_new_tokens: the last number written
    ("She earns 624 * 4 = 2480 dollars per day.\n\nTo find out how many dollars she makes per day, we can "
     "divide the total amount of money she earns by the number of days she sells the remaining eggs. So, "
     "2480 / 4 = 624.\n\nTherefore, Janet makes", "624"),
    # trailing unit
    ("The robe takes 2 * 4 = 8 bolts of blue fiber.\n\nSo, the total number of bolts in the robe is "
     "8 + 4 = 12 bolts.", "12"),
    # dollar signs and thousands commas, trailing period
    ("The total profit is the original price minus the 150% increase, which is $80,000 - $150 = $65,000.", "65000"),
    # cut off inside a number: read as lm-eval's flexible extraction reads it
    ("The total profit is $65,000 - $80,000 = $10,00", "1000"),
    # GSM8K marker and "The answer is:"
    ("So, 60 * 3 = 180 meters.\nTherefore, James runs 180 meters a week.\n#### 180\nThe answer is: 180", "180"),
    # "The answer is" beats the later numbers ("4 hours"); its sentence's result counts
    ("The answer is 24 hours * 60 minutes / 1 hour = 120 minutes.\n\nSo, John spends 120 minutes driving at a "
     "speed of 30mph, which is 120 minutes of his original 4 hours.", "120"),
    # a percent sign after the number
    ("So, the answer is 120% of the price of a single glass is 120", "120"),
    # number words are not numbers
    ("20 * 3 = 60 chickens are fed three times.\nSo, 20 * 3 = 60 chickens are fed three times.\n\n"
     "Now, we can calculate the", "60"),
    # no number at all
    ("To solve this problem, we need to calculate the total amount of fiber required to create the robe. "
     "Since the robe is", None),
]


@pytest.mark.parametrize("text,expected", REAL_OUTPUTS)
def test_extract_answer_on_real_outputs(text, expected):
    assert extract_answer(text) == expected


def test_gold_and_normalisation():
    assert extract_gold("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18") == "18"
    assert extract_gold("... #### 1,200") == "1200"
    assert normalize_number("$1,234.50") == "1234.5"
    assert normalize_number("12.00") == "12"
    assert normalize_number("abc") is None
    assert is_correct("18", "18.0") and not is_correct(None, "18") and not is_correct("17", "18")
    # constructed edge cases (not model outputs): sign, decimals, \\boxed
    assert extract_answer("The temperature changed by -5 degrees.") == "-5"
    assert extract_answer("So each person pays $12.50.") == "12.5"
    assert extract_answer("Final: \\boxed{42} after 3 steps") == "42"
    with pytest.raises(ValueError, match="####"):
        extract_gold("the answer is 4")
    with pytest.raises(ValueError, match="No number"):
        extract_gold("#### none")


# --------------------------------------------------------------------------- data / arguments
def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PROBLEMS = [
    {"question": "Tom has 3 apples and buys 2 more. How many apples does Tom have?", "answer": "3+2=5\n#### 5"},
    {"question": "A box holds 4 pens. How many pens are in 3 boxes?", "answer": "3*4=12\n#### 12"},
]


def test_load_problems_and_errors(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", PROBLEMS)
    probs = load_problems(p)
    assert [x["gold"] for x in probs] == ["5", "12"] and probs[1]["index"] == 1
    assert len(load_problems(p, limit=1)) == 1
    with pytest.raises(ValueError, match="missing.jsonl: no such data file"):
        load_problems(tmp_path / "missing.jsonl")
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*####"):
        load_problems(bad)
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match=r"notjson.jsonl:1:2: not valid JSON"):
        load_problems(tmp_path / "notjson.jsonl")
    with pytest.raises(ValueError, match="limit"):
        load_problems(p, limit=0)


def test_parse_strategies_and_prompt():
    ss = parse_strategies("standard, static:2,confadapt:0.9,static:2")
    assert [s.spec for s in ss] == ["standard", "static:2", "confadapt:0.9:16"]
    with pytest.raises(ValueError, match="Bad strategy"):
        parse_strategies("static:x")
    with pytest.raises(ValueError, match="No strategies"):
        parse_strategies(" , ")
    assert make_prompt(" Q? ") == "Q?"
    assert make_prompt("Q?", step_by_step=True) == f"Q?\n{STEP_BY_STEP}"


# --------------------------------------------------------------------------- scoring (tiny models)
def test_teacher_nll_of_standard_decoding_is_minus_log_confidence(tiny_lm64):
    ids = tiny_lm64.prompt_ids("What is 2 + 3?")
    dec = Decoder(tiny_lm64, ids, standard(), 6)
    recs = list(dec)
    nll, n = teacher_nll(tiny_lm64, ids, dec.generated)
    assert n == len(dec.generated) == 6
    expected = -sum(math.log(r.confidences[0]) for r in recs)
    assert nll == pytest.approx(expected, abs=1e-5)  # confidences are float32
    assert teacher_nll(tiny_lm64, ids, []) == (0.0, 0)


FIELDS = {"strategy", "label", "n", "accuracy", "accuracy_stderr", "effective_k_mean", "effective_k_std",
          "tokens_per_second", "nll_teacher", "agreement_with_standard", "agreement_with_base",
          "new_tokens", "forward_passes", "seconds"}


def test_evaluate_on_tiny_model(tiny_lm, tmp_path):
    probs = load_problems(_write_jsonl(tmp_path / "d.jsonl", PROBLEMS))
    rep = evaluate(tiny_lm, probs, [static_k(2), confadapt(0.0, 4)], max_new_tokens=8, progress=False)
    specs = [r["strategy"] for r in rep["strategies"]]
    assert specs == ["standard", "static:2", "confadapt:0:4"]  # standard added first as the reference
    assert rep["base_standard"] is None and rep["config"]["complete"] and rep["config"]["n_problems"] == 2
    by = {r["strategy"]: r for r in rep["strategies"]}
    for r in by.values():
        assert FIELDS <= set(r) and r["n"] == 2
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
    probs = load_problems(_write_jsonl(tmp_path / "d.jsonl", PROBLEMS))
    rep = evaluate(lm, probs, [standard()], max_new_tokens=6, progress=False)
    base = rep["base_standard"]
    assert base is not None and base["n"] == 2 and rep["config"]["teacher"] == "base model, adapter off"
    # the base run is plain standard decoding of the model with the adapter disabled
    ids = lm.prompt_ids(make_prompt(PROBLEMS[0]["question"]))
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


def test_cli_bad_input_exits_2(tmp_path, capsys):
    assert main(["--data", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and err[0].endswith("none.jsonl: no such data file.")
    d = _write_jsonl(tmp_path / "d.jsonl", PROBLEMS)
    assert main(["--data", str(d), "--strategies", "confadapt:2"]) == 2
    assert "tau" in capsys.readouterr().err
    assert main(["--data", str(d), "--out", str(tmp_path / "x.txt")]) == 2
    assert ".json" in capsys.readouterr().err
    assert main(["--data", str(d), "--max-new-tokens", "0"]) == 2
    assert main(["--strategies", "standard"]) == 2
    assert "--data is required" in capsys.readouterr().err
    assert main(["--rescore", str(d)]) == 2  # a JSONL file is not a report
    assert capsys.readouterr().err.startswith("error: cannot rescore")


# --------------------------------------------------------------------------- real model
@pytest.mark.integration
@pytest.mark.slow
def test_cli_five_gsm8k_problems_default_model(tmp_path, capsys):
    data = GSM8K_SAMPLE
    out = tmp_path / "eval" / "smollm2.json"
    threads = torch.get_num_threads()
    try:
        rc = main(["--data", str(data), "--limit", "5", "--max-new-tokens", "12", "--no-progress",
                   "--strategies", "standard,static:2,confadapt:0.9:4", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["n_problems"] == 5 and rep["config"]["complete"] and rep["config"]["model"] == "smollm2-135m"
    assert [r["strategy"] for r in rep["strategies"]] == ["standard", "static:2", "confadapt:0.9:4"]
    for r in rep["strategies"]:
        assert FIELDS <= set(r) and r["n"] == 5 and 0.0 <= r["accuracy"] <= 1.0
        assert r["nll_teacher"] > 0 and r["tokens_per_second"] > 0 and r["new_tokens"] > 0
    by = {r["strategy"]: r for r in rep["strategies"]}
    assert by["standard"]["effective_k_mean"] == 1.0 and by["standard"]["agreement_with_standard"] == 1.0
    assert 1.0 <= by["confadapt:0.9:4"]["effective_k_mean"] <= 4.0
    assert by["static:2"]["effective_k_mean"] == pytest.approx(2.0, abs=0.25)  # only a stop token cuts a block
    if not rep["config"]["mtp_trained"]:
        # an untrained mask token: static k=2's second tokens are poor guesses, worse under the teacher
        assert by["static:2"]["nll_teacher"] > by["standard"]["nll_teacher"]
    assert len(rep["problems"]) == 5 and all(set(p["results"]) == set(by) for p in rep["problems"])
    assert Path(rep["figure"]["html"]).is_file()
    assert rep["figure"]["png"] is None or Path(rep["figure"]["png"]).is_file()
    assert "static k=2" in capsys.readouterr().out


# The benchmark's tests live in tests/test_bench.py.
