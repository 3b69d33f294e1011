"""Held-out figures (model/training/heldout.py) on a tiny activated-LoRA model: the agreement set's counts and
bounds, and ConfAdapt decoding's effective k at the extreme thresholds."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from model.engine.loading import load_checkpoint
from model.heldout import main
from model.training.heldout import decode_effective_k, format_calibration, score_agreement, setup_for
from model.training.self_answers import as_examples, write_answers
from model.training.config import TrainConfig
from model.training.checkpoints import export_model
from model.training.setup import load_for_training
from model.training.data import Example, encode
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["What is 2 plus 3?", "Name a colour.", "Why is the sky blue?", "Count to five.", "Hello there, how are you?"]


@pytest.fixture
def tiny_alora(base_tokenizer, tmp_path):
    """A tiny Llama with a randomly moved aLoRA adapter (as if trained) and its own greedy answers."""
    tok = copy.deepcopy(base_tokenizer)
    d = tmp_path / "model"
    make_tiny(tok).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    lm = load_checkpoint(str(d), device="cpu")
    rows = write_answers(lm, [Example(p, None) for p in PROMPTS], tmp_path / "answers.jsonl", batch_size=2,
                         max_new_tokens=16, show_progress=False)
    cfg = TrainConfig(base=str(d), data="x", output=str(tmp_path), adapter="alora", lora_rank=4, k_max=4,
                      save_dtype="float32")
    setup = load_for_training(cfg, torch.device("cpu"), lm)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in setup.student.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    setup.student.eval()
    return setup, cfg, as_examples(rows, tmp_path / "answers.jsonl")


def test_agreement_set_counts_and_bounds(tiny_alora):
    setup, _, examples = tiny_alora
    lm = setup.lm
    seqs, starts, _ = encode(lm, examples, 64)
    res = score_agreement(setup_for(lm), lm.model, seqs, starts, k=4, spacing=2, taus=(0.0, 0.5, 1.01), batch_size=2)
    assert res["sequences"] == len(seqs) and res["positions"] == 3 * res["blocks"] > 0
    assert res["sim_k"]["0.0"] == 4.0 and res["sim_k"]["1.01"] == 1.0  # keep all / keep the first only
    assert 1.0 <= res["sim_k"]["0.5"] <= 4.0
    assert res["sim_k_right"]["1.01"] == 1.0  # block position 0 is the base model's greedy token = the answer
    assert res["sim_k_right"]["0.0"] <= res["sim_k"]["0.0"]
    assert 0.0 <= res["agreement"] <= 1.0 and 0.0 <= res["match"] <= 1.0
    assert set(res["by_block"]) == {"1", "2", "3"} and res["agreement_se_cluster"] is not None
    again = score_agreement(setup_for(lm), lm.model, seqs, starts, k=4, spacing=2, taus=(0.0, 0.5, 1.01), batch_size=5)
    assert again["agreement"] == pytest.approx(res["agreement"]) and again["positions"] == res["positions"]
    assert again["calibration"] == res["calibration"]


def test_calibration_table_counts_every_block_position(tiny_alora):
    setup, _, examples = tiny_alora
    lm = setup.lm
    seqs, starts, _ = encode(lm, examples, 64)
    res = score_agreement(setup_for(lm), lm.model, seqs, starts, k=4, spacing=2, taus=(0.0, 0.5, 1.01), batch_size=2)
    cal, blocks = res["calibration"], res["blocks"]
    assert cal["edges"][0] == 0.0 and cal["edges"][-1] == 1.0 and set(cal["by_position"]) == {"0", "1", "2", "3"}
    for j, row in cal["by_position"].items():
        assert sum(row["positions"]) == blocks  # every block's position j lands in one bucket
        assert all(m is None or 0.0 <= m <= 1.0 for m in row["match"])
    # the masks' matches add up to the agreement set's match rate
    masks = sum(m * n for j, row in cal["by_position"].items() if j != "0"
                for m, n in zip(row["match"], row["positions"]) if m is not None)
    assert masks == pytest.approx(res["match"] * res["positions"])
    conf = cal["confident"]
    assert all(v["share"] == 1.0 for v in conf["0.0"].values())  # every confidence >= 0
    assert all(v["share"] == 0.0 and v["match"] is None for v in conf["1.01"].values())
    assert conf["0.0"]["1"]["match"] == pytest.approx(res["by_block"]["1"]["match"])
    text = format_calibration(cal)
    assert text.splitlines()[1].startswith("real") and "mask 3" in text and "confidence >= 0.5" in text


def test_decode_effective_k_extremes_and_cli(tiny_alora, tmp_path):
    setup, cfg, examples = tiny_alora
    lm = setup.lm
    prompts, refs = [e.prompt for e in examples[:3]], [e.response for e in examples[:3]]
    one = decode_effective_k(lm, prompts, refs, taus=(0.9,), k_max=1, max_new_tokens=12)  # no masks: standard
    assert one["0.9"]["effective_k"] == 1.0 and one["0.9"]["same_as_base"] == 1.0  # aLoRA: standard = base
    res = decode_effective_k(lm, prompts, refs, taus=(0.0,), k_max=4, max_new_tokens=12)
    assert res["0.0"]["effective_k"] > 2.5  # every proposal kept (up to the 12-token limit and stops)
    adapter = export_model(cfg, lm, setup.student, tmp_path / "adapter")
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in examples))
    out = tmp_path / "heldout.json"
    assert main(["--answers", str(answers), "--models", str(adapter), "--agreement", "3", "--decode", "2",
                 "--max-new-tokens", "8", "--seq-len", "64", "--dtype", "float32", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())["models"][str(adapter)]
    assert rep["adapter"] == "alora" and rep["agreement_set"]["sequences"] == 3
    assert set(rep["decode"]) == {"0.9", "0.7"}
