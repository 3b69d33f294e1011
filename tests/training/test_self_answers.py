"""Self-distilled training text (model/training/self_answers.py): batched greedy answers equal unbatched ones,
the file is resumable, the trainer reads it. Tiny random models over the real SmolLM2 tokenizer."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from model.engine.loading import wrap_model
from model.engine.decoding import Decoder
from model.engine.strategies import standard
from model.self_answers import main
from model.training.self_answers import as_examples, greedy_answers, write_answers
from model.training.config import TrainConfig
from model.training.data import mix_reference
from model.training.trainer import train
from model.training.data import Example, load_examples
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PROMPTS = ["Hi", "What is 2 plus 3?", "Name three colours of the rainbow, please, in order.", "Why?",
           "Write one short sentence about a cat that sleeps on a warm windowsill in the afternoon sun."]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, base_tokenizer):
    """A local HF model directory: a tiny random Llama + the real SmolLM2 tokenizer."""
    d = tmp_path_factory.mktemp("tiny") / "model"
    tok = copy.deepcopy(base_tokenizer)
    make_tiny(tok).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


def _unbatched(lm, prompt_ids, n):
    dec = Decoder(lm, prompt_ids, standard(), n)
    for _ in dec:
        pass
    return dec.result().token_ids


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_answers_equal_unbatched_greedy(base_tokenizer, dtype):
    """Batched answers give, row for row, the engine's own unbatched greedy answer (standard decoding) and
    the answer for the prompt alone; prompts of different lengths in one batch. float64 runs through
    generate (left-padded, 2 to 30+ tokens of padding); float32 on our kernels where they load, through
    shared passes (BatchRunner), else through generate too."""
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok, dtype=dtype), tok, source="tiny")
    ids = [lm.prompt_ids(p) for p in PROMPTS]
    assert max(map(len, ids)) - min(map(len, ids)) > 10
    batched = greedy_answers(lm, ids, 12)
    for p, b in zip(ids, batched):
        assert b == _unbatched(lm, p, 12)
        assert b == greedy_answers(lm, [p], 12)[0]
    assert len({tuple(b) for b in batched}) >= 4  # the answers depend on the prompt: a real check


def test_stop_token_ends_the_answer(base_tokenizer):
    """An answer ends at the first stop token (included in the ids, marked stopped in the file, left
    out of the text); the mask token is never generated."""
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok, dtype=torch.float64), tok, source="tiny")
    ids = lm.prompt_ids(PROMPTS[1])
    free = greedy_answers(lm, [ids], 8)[0]
    # Make the 3rd greedy token a stop token: it is the one the model would emit there anyway.
    lm.stop_token_ids = (*lm.stop_token_ids, free[2])
    got = greedy_answers(lm, [ids, lm.prompt_ids(PROMPTS[0])], 8)
    assert got[0] == free[: free.index(free[2]) + 1]
    assert all(lm.mask_token_id not in a for a in got)


def test_answer_file_resumes_and_trains(base_tokenizer, tmp_path):
    """A file written for 3 prompts, with its last line cut (a killed run), is completed to 5 without
    redoing the others; load_examples reads it (prompt/response) and the trainer trains on it; the
    reference mix swaps a share of rows to their reference answers."""
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok), tok, source="tiny")
    examples = [Example(p, f"reference {i}") for i, p in enumerate(PROMPTS)]
    path = tmp_path / "answers.jsonl"
    rows3 = write_answers(lm, examples, path, limit=3, batch_size=2, max_new_tokens=6, show_progress=False)
    lines = path.read_text().splitlines()
    assert [r["index"] for r in rows3] == [0, 1, 2] and len(lines) == 3
    path.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])  # the third row half written
    rows5 = write_answers(lm, examples, path, limit=5, batch_size=2, max_new_tokens=6, show_progress=False)
    assert [r["index"] for r in rows5] == [0, 1, 2, 3, 4]
    assert rows5[:3] == rows3  # identical regeneration of the cut row, the first two reused
    done = [json.loads(x) for x in path.read_text().splitlines()[:2]]
    assert done == rows3[:2]
    for r in rows5:
        assert r["reference"] == f"reference {r['index']}" and r["tokens"] == 6 and not r["stopped"]
        assert r["generated_by"] == "tiny"
    got = load_examples(str(path))
    assert {e.prompt for e in got} == set(PROMPTS) and all(e.reference for e in got)
    mixed = mix_reference(got, 1.0, seed=0)
    assert all(e.response == e.reference for e in mixed)
    assert mix_reference(got, 0.0, seed=0) == got
    half = mix_reference(as_examples(rows5, path), 0.5, seed=1)
    assert half == mix_reference(as_examples(rows5, path), 0.5, seed=1)  # seeded
    cfg = TrainConfig(base="tiny", data=str(path), output=str(tmp_path / "run"), adapter="alora", lora_rank=4,
                      max_steps=2, batch_size=2, seq_len=64, k_max=4, spacing=4, lr=1e-3, warmup=0, save_every=100)
    rec = train(cfg, lm=lm, examples=got)
    assert rec["step"] == 2 and rec["predictions"] > 0


def test_empty_answers_are_done_but_not_trained(tmp_path):
    """A generated empty answer (immediate EOS) stays in the file (done) but is no training example."""
    path = tmp_path / "a.jsonl"
    rows = [{"index": 0, "prompt": "a?", "response": "", "reference": None, "tokens": 0, "stopped": True,
             "generated_by": "x"},
            {"index": 1, "prompt": "b?", "response": "b.", "reference": None, "tokens": 2, "stopped": True,
             "generated_by": "x"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [e.prompt for e in load_examples(str(path))] == ["b?"]
    assert [e.prompt for e in as_examples(rows, path)] == ["b?"]


def test_cli_and_trainer_self_distill(tmp_path, tiny_model_dir):
    """The CLI writes the file from a question-only JSONL; the trainer's --self-distill-answers N does
    the same (batched) into its output directory and trains on it."""
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "answers.jsonl"
    assert main(["--base", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--batch-size", "2",
                 "--max-new-tokens", "5", "--limit", "4", "--dtype", "float32", "--no-progress"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == [0, 1, 2, 3] and all(r["reference"] is None for r in rows)
    from model.train import main as train_main

    run = tmp_path / "run"
    assert train_main(["--base", str(tiny_model_dir), "--data", str(data), "--output", str(run),
                       "--self-distill-answers", "4", "--answer-max-new-tokens", "5", "--answer-batch-size", "3",
                       "--batch-size", "2", "--k-max", "3", "--seq-len", "64", "--max-steps", "1",
                       "--mixed-precision", "no"]) == 0
    mine = {r["index"]: r["response"] for r in rows}
    theirs = {json.loads(x)["index"]: json.loads(x)["response"] for x in (run / "self_answers.jsonl").read_text().splitlines()}
    assert theirs == mine  # one generator: the same answers through the trainer and the CLI


def test_default_recipe_script_runs_tiny_and_resumes(tmp_path, tiny_model_dir):
    """scripts/train_default.sh end to end on a tiny model (the GPU path with tiny settings, on the
    CPU): answers, training, one compact checkpoint + final in OUT; a rerun with more steps resumes
    from that checkpoint and reuses the answers; DRY_RUN=1 GPU=1 prints the GPU commands."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": p, "answer": "#### 1"}) + "\n" for p in PROMPTS))
    out, answers = tmp_path / "out", tmp_path / "answers" / "a.jsonl"
    env = {**os.environ, "PY": sys.executable, "BASE": str(tiny_model_dir), "DATA": str(data), "OUT": str(out),
           "ANSWERS_FILE": str(answers), "CONTINUE": "0", "ANSWERS": "4", "MAX_NEW": "6", "MAX_STEPS": "2",
           "BATCH": "2", "SEQ_LEN": "64", "SAVE_EVERY": "1", "GPU": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "MAGPIE": "0", "LR_SCHEDULE": "constant"}
    script = str(ROOT / "scripts" / "train_default.sh")
    r = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in answers.read_text().splitlines()]
    assert sorted(x["index"] for x in rows) == [0, 1, 2, 3]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "final", "train_log.jsonl"]
    opt = torch.load(out / "checkpoint-2" / "optimizer.bin", weights_only=False)["state"]
    assert all(st["exp_avg"].dtype == torch.bfloat16 for st in opt.values())  # compact checkpoint
    r = subprocess.run(["bash", script], env={**env, "MAX_STEPS": "3"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "greedy answers" not in r.stderr  # nothing left to generate
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "final", "train_log.jsonl"]
    assert (out / "final" / "mtp_adapter.json").is_file()
    assert json.loads((out / "final" / "mtp_adapter.json").read_text())["adapter"] == "alora"
    dry = subprocess.run(["bash", script], env={**env, "DRY_RUN": "1", "GPU": "1", "BATCH": "", "MINUTES": "90"},
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and "--batch-size 64" in dry.stdout and "--max-minutes 90" in dry.stdout
    # the default recipe (MAGPIE=2640): self-written instructions, their answers, DATA's answers, the 3 : 1 mix
    dry = subprocess.run(["bash", script], env={k: v for k, v in {**env, "DRY_RUN": "1"}.items()
                                                if k not in ("MAGPIE", "LR_SCHEDULE")},
                         capture_output=True, text=True, timeout=60)
    lines = dry.stdout.splitlines()
    assert dry.returncode == 0 and len(lines) == 5, dry.stdout + dry.stderr
    assert "model.magpie instructions" in lines[0] and "--count 2640" in lines[0]
    assert "model.magpie mix" in lines[3] and "answers.jsonl=3" in lines[3] and f"{answers}=1" in lines[3]
    assert "--data runs/magpie/train_mix.jsonl" in lines[4] and "--lr-schedule cosine --warmup 20" in lines[4]
    # the default (CONTINUE=1) continues the shipped adapter at its own rank: a smaller --lora-rank would be refused
    shipped = json.loads((ROOT / "assets" / "smollm2-135m-mtp" / "adapter_config.json").read_text())["r"]
    dry = subprocess.run(["bash", script], env={**env, "DRY_RUN": "1", "BASE": "smollm2-135m", "CONTINUE": "1"},
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "--init-adapter assets/smollm2-135m-mtp" in dry.stdout and f"--lora-rank {shipped} " in dry.stdout
    # both cores of a CPU: DDP through accelerate launch, with the schedule of the shipped adapter's last run
    dry = subprocess.run(["bash", script], env={**env, "DRY_RUN": "1", "PROCS": "2", "LR": "5e-4",
                                                "LR_SCHEDULE": "cosine", "SEED": "4"},
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "accelerate launch --multi_gpu --num_processes 2 " in dry.stdout
    assert "--lr 5e-4 --lr-schedule cosine --warmup 20 " in dry.stdout and "--seed 4 " in dry.stdout
