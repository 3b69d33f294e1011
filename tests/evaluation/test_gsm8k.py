"""GSM8K (model/evaluation/gsm8k.py): answer extraction on real model outputs, gold answers and
number normalisation, reading problem files."""

from __future__ import annotations

import pytest

from model.evaluation.gsm8k import extract_answer, extract_gold, is_correct, load_problems, normalize_number
from tests.conftest import GSM8K_PROBLEMS, write_jsonl


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


def test_load_problems_and_errors(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", GSM8K_PROBLEMS)
    probs = load_problems(p)
    assert [x["gold"] for x in probs] == ["5", "12"] and probs[1]["index"] == 1
    assert len(load_problems(p, limit=1)) == 1
    shard = load_problems(p, limit=1, offset=1)  # the second problem, with its index in the file
    assert [(x["index"], x["gold"]) for x in shard] == [(1, "12")]
    with pytest.raises(ValueError, match="holds no problems after the first 2"):
        load_problems(p, offset=2)
    with pytest.raises(ValueError, match="--offset must be an integer ≥ 0"):
        load_problems(p, offset=-1)
    with pytest.raises(ValueError, match="missing.jsonl: no such data file"):
        load_problems(tmp_path / "missing.jsonl")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*####"):
        load_problems(bad)
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match=r"notjson.jsonl:1:2: not valid JSON"):
        load_problems(tmp_path / "notjson.jsonl")
    with pytest.raises(ValueError, match="limit"):
        load_problems(p, limit=0)
