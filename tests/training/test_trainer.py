"""The trainer (model/training/trainer.py, paper 3.3): learning, bf16 autocast, DDP, resume, export,
activated-LoRA checkpoints, a non-finite loss. CPU, tiny random models over the real SmolLM2
tokenizer; one integration test on SmolLM2 itself."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.engine.decoding import Decoder, generate, hf_generate
from model.engine.loading import load_checkpoint, wrap_model
from model.engine.strategies import confadapt, standard
from model.train import main
from model.training.config import TrainConfig
from model.training.checkpoints import export_model
from model.training.setup import load_for_training
from model.errors import CheckpointError
from tests.conftest import GSM8K_SAMPLE, GSM8K_TRAIN16, ROOT, make_tiny, mtp_run, pretrained_teacher, train_args


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT),
       "OMP_NUM_THREADS": "1"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------- learning
def test_mtp_training_raises_teacher_agreement(base_tokenizer, tmp_path):
    """40 MTP steps (LoRA r=8 + mask row, lr 1e-2, k in [2, 4], batch 4, float32) on a teacher that
    knows its corpus raise teacher agreement at mask positions from ~0.2 to ~0.9.

    Robust across machines: floating-point trajectories differ between CPUs of the same kind (one
    run ended at 0.96 on one machine and 0.851 on another, deterministically), and one 40-step run
    ends anywhere in ~0.84-0.95 depending on seeds (measured over 9 pre-training x MTP seeds). So
    three MTP seeds are averaged over their last 10 steps, and the bar (0.75, with a rise of at
    least 0.3 over each run's first step) sits well below the 0.88-0.94 seed means measured. The
    confidence at masks is checked the same way, as calibration (its last-10-step mean within 0.15 of
    the agreement's; measured 0.006-0.05 against 0.34-0.62 at the first step), not as the last step
    above the first (one step's confidence swings with its k: 0.72 after 0.81 on one machine). About
    15 s (one torch thread)."""
    lm, examples = pretrained_teacher(base_tokenizer)
    starts, ends = [], []
    for seed in (0, 1, 2):
        log = mtp_run(lm, examples, tmp_path / f"run{seed}", seed=seed)
        assert len(log) == 40 and log[0]["mixed_precision"] == "no"
        start = log[0]["agreement_mask"]
        end = sum(r["agreement_mask"] for r in log[-10:]) / 10
        assert end > start + 0.3, (seed, start, end)
        # ConfAdapt reads the student's confidence as the chance of being right: the untrained masks are
        # confident and wrong (confidence ~0.8 at agreement ~0.2); training brings the two together
        conf_start, conf_end = log[0]["confidence_mask"], sum(r["confidence_mask"] for r in log[-10:]) / 10
        assert abs(conf_end - end) < 0.15 and abs(conf_end - end) < abs(conf_start - start) - 0.2, (
            seed, start, conf_start, end, conf_end)
        assert {r["k"] for r in log} <= {2, 3, 4} and len({r["k"] for r in log}) > 1
        starts.append(start)
        ends.append(end)
    for key in ("loss", "confidence", "agreement", "k", "seqs_per_s", "cpu_total", "seen"):
        assert key in log[0]
    assert sum(starts) / 3 < 0.5 and sum(ends) / 3 > 0.75, (starts, ends)


def test_bf16_autocast_matches_float32(base_tokenizer, tmp_path):
    """bf16 mixed precision (autocast, float32 master weights) follows the float32 run on the same
    steps: same k and offsets, losses within bf16 noise (a few per cent); ``auto`` picks bf16
    exactly where :func:`model.precision.native_bf16` says the CPU runs it natively."""
    from model.engine.precision import native_bf16

    lm, examples = pretrained_teacher(base_tokenizer)
    for adapter in ("lora", "alora"):
        f32 = mtp_run(lm, examples, tmp_path / f"f32-{adapter}", steps=6, mixed_precision="no", adapter=adapter)
        bf16 = mtp_run(lm, examples, tmp_path / f"bf16-{adapter}", steps=6, mixed_precision="bf16", adapter=adapter)
        assert bf16[0]["mixed_precision"] == "bf16"
        assert [(r["k"], r["offset"]) for r in f32] == [(r["k"], r["offset"]) for r in bf16]
        for a, b in zip(f32[:3], bf16[:3]):  # first steps: same weights up to bf16 rounding
            assert abs(a["loss"] - b["loss"]) <= 0.05 * a["loss"] + 0.02, (adapter, a["loss"], b["loss"])
        assert all(math.isfinite(r["loss"]) for r in bf16)
        assert bf16[0]["loss"] != f32[0]["loss"]  # it really ran in bf16
    auto = mtp_run(lm, examples, tmp_path / "auto", steps=1, mixed_precision="auto")
    assert auto[0]["mixed_precision"] == ("bf16" if native_bf16("cpu") else "no")


# ----------------------------------------------------------------- DDP and FSDP
def _launch(out: Path, port: int, launcher: list[str], *extra: str, tiny_train_dir: Path) -> subprocess.CompletedProcess:
    """``accelerate launch LAUNCHER --num_processes 2 -m model.train`` of a short run on the tiny model."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", *launcher, "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
           "-m", "model.train", *train_args(tiny_train_dir, out, *extra)]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_ddp_two_processes_identical_weights(tiny_train_dir, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on a CPU-only machine runs gloo DDP
    (the trainer sets cpu=True without CUDA); after 3 LoRA steps both ranks hold identical weights."""
    out = tmp_path / "ddp"
    if torch.cuda.is_available():
        pytest.skip("this check is for CPU-only machines")
    r = _launch(out, 29533, ["--multi_gpu"], "--max-steps", "3", "--debug-dump-params", tiny_train_dir=tiny_train_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    d0 = json.loads((out / "params_rank0.json").read_text())
    d1 = json.loads((out / "params_rank1.json").read_text())
    assert d0["step"] == d1["step"] == 3 and d0["sha256"] == d1["sha256"]
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and log[0]["sequences"] == 4  # 2 per process x 2
    assert {p.name for p in (out / "checkpoint-3").iterdir()} >= {"random_states_0.pkl", "random_states_1.pkl"}
    # The exported adapter loads with the engine's loader and decodes with ConfAdapt.
    lm = load_checkpoint(str(out / "final"), device="cpu")
    assert lm.adapter == "lora" and lm.mtp_trained
    dec = Decoder(lm, lm.prompt_ids("What is 2 plus 3?"), confadapt(0.5, 4), max_new_tokens=8)
    recs = list(dec)
    assert recs[0].fed_masks == 3 and 1 <= dec.result().new_tokens <= 8
    assert (out / "final" / "adapter_model.safetensors").stat().st_size < 2_000_000


def test_fsdp_full_fine_tune_on_two_cpu_processes(tiny_train_dir, tmp_path, capsys):
    """`accelerate launch --use_fsdp --num_processes 2` of a full fine-tune on a CPU: the trainer shards
    student and teacher with FSDP2 over gloo. Two steps, a checkpoint of the whole weights, then a
    resumed launch to step 4. The weights equal (within float reduction order) one process running the
    same 4 steps with --grad-accum 2: the same two half-batches of 2, their gradients averaged."""
    if torch.cuda.is_available():
        pytest.skip("this check is for CPU-only machines")
    # float32 (not "auto"): on a CPU with native bf16, autocast's roundings differ between the sharded and the
    # single-process reductions by more than the 1e-4 this equivalence is checked to (it failed there).
    full = ["--lora-rank", "0", "--save-every", "2", "--keep-checkpoints", "3", "--mixed-precision", "no"]
    sharded, single = tmp_path / "fsdp", tmp_path / "single"
    r = _launch(sharded, 29541, ["--use_fsdp"], *full, "--max-steps", "2", "--debug-dump-params",
                tiny_train_dir=tiny_train_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    cp = sharded / "checkpoint-2"
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "random_states_1.pkl"} <= {p.name for p in cp.iterdir()}
    whole = load_file(str(cp / "model.safetensors"))  # the whole weights, not one process's slice
    base = load_file(str(tiny_train_dir / "model" / "model.safetensors"))
    assert whole.keys() >= base.keys() and all(whole[k].shape == base[k].shape for k in base)
    d0, d1 = (json.loads((sharded / f"params_rank{i}.json").read_text()) for i in (0, 1))
    assert d0["step"] == d1["step"] == 2 and d0["sha256"] == d1["sha256"]  # the gathered weights
    r = _launch(sharded, 29542, ["--use_fsdp"], *full, "--max-steps", "4", "--resume", "auto",
                tiny_train_dir=tiny_train_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "checkpoint-2" in r.stderr
    args = train_args(tiny_train_dir, single, *full, "--max-steps", "4", "--grad-accum", "2")
    assert main(args) == 0
    log_s = [json.loads(x) for x in (sharded / "train_log.jsonl").read_text().splitlines()]
    log_1 = [json.loads(x) for x in (single / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log_s] == [1, 2, 3, 4] and log_s[0]["sequences"] == log_1[0]["sequences"] == 4
    assert [(r["k"], r["offset"]) for r in log_s] == [(r["k"], r["offset"]) for r in log_1]
    assert all(math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(log_s, log_1))
    ws, w1 = (load_file(str(d / "checkpoint-4" / "model.safetensors")) for d in (sharded, single))
    assert ws.keys() == w1.keys()
    assert max(float((ws[k] - w1[k]).abs().max()) for k in ws) < 1e-4
    assert not all(torch.equal(ws[k], whole[k]) for k in ws)  # steps 3-4 did train
    lm = load_checkpoint(str(sharded / "final"), device="cpu", dtype="float32")
    assert lm.mtp_trained and lm.adapter is None
    dec = Decoder(lm, lm.prompt_ids("What is 1 plus 2?"), confadapt(0.5, 4), max_new_tokens=6)
    assert 1 <= len(list(dec)) <= 6
    # A sharded run's checkpoint resumed without FSDP is refused with a clear message (its AdamW file differs).
    capsys.readouterr()
    assert main(train_args(tiny_train_dir, sharded, *full, "--max-steps", "5", "--resume", "auto")) == 2
    err = capsys.readouterr().err
    assert "written by a run with FSDP" in err and "Traceback" not in err


# --------------------------------------------------------------- resume, export
def test_kill_and_resume_equals_uninterrupted(tiny_train_dir, tmp_path):
    """Full fine-tune, 4 steps: killed (SIGKILL) right after the step-2 checkpoint and resumed ==
    uninterrupted, bit for bit (weights, optimizer state, log)."""
    a, b = tmp_path / "a", tmp_path / "b"
    base = ["--lora-rank", "0", "--max-steps", "4", "--save-every", "2", "--keep-checkpoints", "3"]
    assert main(train_args(tiny_train_dir, a, *base)) == 0
    r = subprocess.run([sys.executable, "-m", "model.train", *train_args(tiny_train_dir, b, *base, "--debug-crash-after-step", "2")],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    assert (b / "checkpoint-2").is_dir() and not (b / "checkpoint-3").exists() and not (b / "final").exists()
    with (b / "train_log.jsonl").open("a") as f:  # as if step 3 had been logged before the kill
        f.write(json.dumps({"step": 3, "loss": 0.0}) + "\n")
    assert main(train_args(tiny_train_dir, b, *base, "--resume", "auto")) == 0
    wa, wb = load_file(str(a / "checkpoint-4" / "model.safetensors")), load_file(str(b / "checkpoint-4" / "model.safetensors"))
    w2 = load_file(str(b / "checkpoint-2" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], w2[k]) for k in wa)  # steps 3-4 did change the weights
    oa = torch.load(a / "checkpoint-4" / "optimizer.bin", weights_only=False)["state"]
    ob = torch.load(b / "checkpoint-4" / "optimizer.bin", weights_only=False)["state"]
    assert all(torch.equal(oa[i]["exp_avg"], ob[i]["exp_avg"]) for i in oa)
    la = [json.loads(x) for x in (a / "train_log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (b / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lb] == [1, 2, 3, 4]
    assert [(r["loss"], r["k"], r["offset"]) for r in la] == [(r["loss"], r["k"], r["offset"]) for r in lb]
    # The full-model export is a model directory the engine loads (tokenizer with the mask token).
    lm = load_checkpoint(str(a / "final"), device="cpu", dtype="float32")  # "auto" is bf16 on native-bf16 CPUs
    assert lm.mtp_trained and lm.adapter is None
    assert lm.model.model.embed_tokens.weight.dtype == torch.float32
    dec = Decoder(lm, lm.prompt_ids("What is 1 plus 2?"), confadapt(0.5, 4), max_new_tokens=6)
    assert 1 <= len(list(dec)) <= 6


def test_lora_export_reloads_exactly(tiny_train_dir, tmp_path):
    """An adapter export (float32 here) reloads through load_checkpoint with identical logits,
    masks included (adapter + trained mask row)."""
    cfg = TrainConfig(base=str(tiny_train_dir / "model"), data="x", output=str(tmp_path), lora_rank=4, save_dtype="float32")
    setup = load_for_training(cfg, torch.device("cpu"))
    lm = setup.lm
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in setup.student.named_parameters():
            if p.requires_grad:  # stand-in for training: move every trainable weight
                p.add_(torch.randn_like(p) * 0.5)
    setup.student.eval()
    out = export_model(cfg, lm, setup.student, tmp_path / "final")
    meta = json.loads((out / "mtp_adapter.json").read_text())
    assert meta["adapter"] == "lora" and meta["base"] == str((tiny_train_dir / "model").resolve())
    back = load_checkpoint(str(out), device="cpu", dtype="float32")  # exactness check: float32 explicitly
    ids = torch.tensor([lm.prompt_ids("Hello there") + [lm.mask_token_id] * 3])
    with torch.no_grad():
        want = setup.student(input_ids=ids).logits
        got = back.model(input_ids=ids).logits
        base = back.model.get_base_model()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    rows = load_file(str(out / "mask_rows.safetensors"))["embed"]
    assert torch.allclose(base.get_input_embeddings().weight[lm.mask_token_id], rows[0])
    # --init-adapter continues from that adapter (lr 1e-12: the weights barely move) and keeps its base.
    run = tmp_path / "cont"
    assert main(train_args(tiny_train_dir, run, "--init-adapter", out, "--max-steps", "1", "--lr", "1e-12", "--warmup", "0",
                            "--save-dtype", "float32")) == 0
    a, b = load_file(str(out / "adapter_model.safetensors")), load_file(str(run / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert any(a[k].abs().max() > 0.1 for k in a if "lora_B" in k)
    assert json.loads((run / "final" / "mtp_adapter.json").read_text())["base"] == meta["base"]


def test_adapter_checkpoints_hold_trainable_weights_and_resume_exactly(tiny_train_dir, tmp_path):
    """An aLoRA run's checkpoint holds only the trainable weights (no frozen base) and resumes bit for
    bit; --compact-checkpoints stores the AdamW moments in bf16 (smaller) and still resumes."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    base = ["--adapter", "alora", "--lora-rank", "4", "--max-steps", "4", "--save-every", "2", "--keep-checkpoints", "3",
            "--mixed-precision", "no", "--save-dtype", "float32"]
    assert main(train_args(tiny_train_dir, a, *base)) == 0
    assert main(train_args(tiny_train_dir, b, *base, "--max-steps", "2")) == 0
    assert main(train_args(tiny_train_dir, b, *base, "--resume", "auto")) == 0
    wa, wb = load_file(str(a / "checkpoint-4" / "model.safetensors")), load_file(str(b / "checkpoint-4" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all("lora_" in k or "trainable_tokens" in k for k in wa)  # no frozen base weights
    fa = load_file(str(a / "final" / "adapter_model.safetensors"))
    fb = load_file(str(b / "final" / "adapter_model.safetensors"))
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    assert main(train_args(tiny_train_dir, c, *base, "--max-steps", "2", "--compact-checkpoints")) == 0
    opt = torch.load(c / "checkpoint-2" / "optimizer.bin", weights_only=False)["state"]
    assert all(st["exp_avg"].dtype == torch.bfloat16 for st in opt.values())
    assert (c / "checkpoint-2" / "optimizer.bin").stat().st_size < 0.7 * (a / "checkpoint-2" / "optimizer.bin").stat().st_size
    assert main(train_args(tiny_train_dir, c, *base, "--compact-checkpoints", "--resume", "auto")) == 0
    lc = [json.loads(x) for x in (c / "train_log.jsonl").read_text().splitlines()]
    la = [json.loads(x) for x in (a / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lc] == [1, 2, 3, 4]
    assert lc[2]["loss"] == pytest.approx(la[2]["loss"], rel=1e-2)  # bf16 moments: close, not exact


def test_non_finite_loss_stops_with_message_and_keeps_checkpoint(tiny_train_dir, tmp_path, capsys):
    """lr 1e30 blows the weights up after step 1: step 2's loss is not finite. The run stops with a
    clear message (exit 1), updates nothing, logs no NaN (strict JSON) and leaves checkpoint-1."""
    out = tmp_path / "nan"
    code = main(train_args(tiny_train_dir, out, "--max-steps", "4", "--save-every", "1", "--lr", "1e30", "--warmup", "0",
                            "--mixed-precision", "no"))
    err = capsys.readouterr().err
    assert code == 1 and "non-finite loss or gradient" in err and "checkpoint-1" in err, err[-2000:]
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]  # strict JSON parses
    assert [r["step"] for r in log] == [1]
    assert (out / "checkpoint-1").is_dir() and not (out / "checkpoint-2").exists() and not (out / "final").exists()


# --------------------------------------------------------------- activated LoRA
def test_cli_alora_checkpoint_saves_reloads_and_decodes(base_tokenizer, tmp_path):
    tok = copy.deepcopy(base_tokenizer)
    d = tmp_path / "tiny"
    make_tiny(tok).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Add {i} and {i}.", "response": f"{i} plus {i} is {2 * i}."}) + "\n"
                            for i in range(8)))
    out = tmp_path / "run"
    assert main(["--base", str(d), "--data", str(data), "--output", str(out), "--adapter", "alora", "--lora-rank", "4",
                 "--max-steps", "2", "--batch-size", "2", "--k-max", "4", "--seq-len", "40", "--lr", "1e-2",
                 "--prompt-format", "bos_newlines",
                 "--warmup", "0"]) == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(r["loss"] > 0 for r in log)
    mtp = load_checkpoint(str(out / "final"), device="cpu")
    base = load_checkpoint(str(d), device="cpu")
    assert mtp.adapter == "alora" and mtp.mtp_trained and mtp.prompt_format == "bos_newlines"
    base.prompt_format = "bos_newlines"
    ids = mtp.prompt_ids("Add 2 and 2.")
    assert generate(mtp, "Add 2 and 2.", standard(), 12).token_ids == hf_generate(base, ids, 12)
    dec = Decoder(mtp, ids, confadapt(0.5, 4), max_new_tokens=12)
    recs = list(dec)
    assert recs[0].fed_masks == 3 and len(recs[0].proposals) == 4 and dec.result().new_tokens >= 1


@pytest.mark.integration
def test_smollm2_alora_standard_is_base_and_blocks_start_with_base_greedy(smollm2, tmp_path):
    """An aLoRA adapter (random, non-zero weights) on SmolLM2, saved and loaded with the engine's
    loader: standard decoding == the base model's HF generate token for token; every ConfAdapt block
    starts with the base model's greedy token."""
    tok = copy.deepcopy(smollm2.tokenizer)
    lm = wrap_model(copy.deepcopy(smollm2.model), tok, source="smollm2-135m")
    cfg = TrainConfig(base="smollm2-135m", data="x", output=str(tmp_path), adapter="alora", lora_rank=4)
    setup = load_for_training(cfg, torch.device("cpu"), lm=lm)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in setup.student.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    out = export_model(cfg, setup.lm, setup.student, tmp_path / "alora")
    assert json.loads((out / "mtp_adapter.json").read_text())["adapter"] == "alora"
    mtp = load_checkpoint(str(out), device="cpu")
    assert mtp.adapter == "alora" and mtp.mask_token_id == smollm2.mask_token_id
    assert (out / "adapter_model.safetensors").stat().st_size < 8_000_000  # no whole embedding matrix
    n = 16
    for q in ["What is 15 plus 27?"]:
        ids = smollm2.prompt_ids(q)
        want = hf_generate(smollm2, ids, n)
        assert generate(mtp, q, standard(), n).token_ids == want
        dec = Decoder(mtp, ids, confadapt(0.0, 4), max_new_tokens=n)  # tau 0: keep whole blocks of 4
        recs = list(dec)
        got = dec.result().token_ids
        with torch.no_grad():
            logits = smollm2.model(input_ids=torch.tensor([ids + got])).logits[0].float()
        logits[:, smollm2.mask_token_id] = float("-inf")
        greedy = logits.argmax(-1)
        i = 0
        for r in recs:
            assert r.kept[0] == int(greedy[len(ids) + i - 1]), (r.index, r.kept)
            i += len(r.kept)
        assert any(r.accepted > 1 for r in recs)
        assert got != want  # the adapter's mask proposals are not the base's continuation


# ------------------------------------------------------------------ data a run can meet
@pytest.mark.parametrize("position", ["first", "second"])
def test_a_one_token_answer_never_ends_the_run(tiny_train_dir, tmp_path, position):
    """A row whose answer is one token ("4") holds an MTP region at every grid offset (the offset wraps
    within a short answer), so a batch is never empty: batch size 1, k_max 4, the row first or second."""
    short = {"question": "What is 2+2?", "answer": "4"}
    other = {"question": "What is 3 plus 4?", "answer": "3 plus 4 is 7.\n#### 7"}
    rows = [short, other] if position == "first" else [other, short]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert main(["--base", str(tiny_train_dir / "model"), "--data", str(data), "--output", str(out), "--batch-size", "1",
                 "--seq-len", "64", "--k-max", "4", "--max-steps", "8", "--lr", "1e-3", "--warmup", "1"]) == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 9)) and all("loss" in r for r in log)
    assert (out / "final" / "mtp_adapter.json").is_file()


@pytest.mark.parametrize("source", ["train", "test"])
def test_rows_with_no_room_are_skipped_and_counted(tiny_train_dir, tmp_path, capsys, source):
    """The first 16 GSM8K train rows (tests/data/gsm8k_train16.jsonl, the rows a run died on) and the first
    16 test rows, with --seq-len 96 --batch-size 2 --k-max 8 --lora-rank 4: the rows whose prompt fills the
    sequence are skipped (named with file:line, counted on stderr and in the log) and the run trains on
    the rest."""
    out = tmp_path / "run"
    data = tmp_path / "gsm8k16.jsonl"
    rows = GSM8K_TRAIN16 if source == "train" else GSM8K_SAMPLE
    data.write_text("".join(rows.read_text().splitlines(keepends=True)[:16]))
    assert main(["--base", str(tiny_train_dir / "model"), "--data", str(data), "--output", str(out), "--batch-size", "2",
                 "--seq-len", "96", "--k-max", "8", "--lora-rank", "4", "--max-steps", "4", "--warmup", "1"]) == 0
    err = capsys.readouterr().err
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    event = log[0]
    assert event["event"] == "data" and event["skipped"] >= 1 and event["sequences"] + event["skipped"] == 16
    if source == "train":  # the 7 prompts of 98-142 tokens that the crashed run dropped
        assert event["skipped"] == 7
    assert all(row.startswith(f"{data}:") and "no room for an answer token" in row for row in event["skipped_rows"])
    assert f"note: {event['skipped']} of 16 examples skipped" in err
    assert [r["step"] for r in log[1:]] == [1, 2, 3, 4]


def test_growing_an_adapter_keeps_what_it_computes(base_tokenizer, tmp_path):
    """--init-adapter with a larger --lora-rank: new A rows random, new B columns zero, alpha scaled with the
    rank: the grown adapter computes what the saved one did (float64), and has more to train."""
    tok = copy.deepcopy(base_tokenizer)
    d = tmp_path / "base"
    make_tiny(tok, dtype=torch.float64).save_pretrained(d)
    tok.save_pretrained(d)
    cfg = TrainConfig(base=str(d), data="x", output=str(tmp_path / "a"), adapter="alora", lora_rank=4,
                      save_dtype="float32")
    setup = load_for_training(cfg, torch.device("cpu"))
    with torch.no_grad():
        for n, p in setup.student.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    setup.student.eval()
    export_model(cfg, setup.lm, setup.student, tmp_path / "r4")
    grown = load_for_training(TrainConfig(base=str(d), data="x", adapter="alora", init_adapter=str(tmp_path / "r4"),
                                          lora_rank=12), torch.device("cpu"))
    same = load_for_training(TrainConfig(base=str(d), data="x", adapter="alora", init_adapter=str(tmp_path / "r4")),
                             torch.device("cpu"))
    assert grown.student.peft_config["default"].r == 12 and same.student.peft_config["default"].r == 4
    ids = torch.tensor([setup.lm.prompt_ids("Hello there") + [setup.lm.mask_token_id] * 3])
    with torch.no_grad():
        a = grown.student.eval()(input_ids=ids, alora_offsets=[3]).logits
        b = same.student.eval()(input_ids=ids, alora_offsets=[3]).logits
    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)
    assert not torch.allclose(a, setup.lm.model.get_base_model()(input_ids=ids).logits)  # the adapter acts
    n = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
    assert n(grown.student) > n(same.student)
    with pytest.raises(CheckpointError, match="grow, not shrink"):
        load_for_training(TrainConfig(base=str(d), data="x", adapter="alora", init_adapter=str(tmp_path / "r4"),
                                      lora_rank=2), torch.device("cpu"))


def test_cosine_schedule_decays_to_a_tenth():
    from model.training.setup import build_optimizer

    cfg = TrainConfig(data="x", lr=1.0, warmup=2, max_steps=12, lr_schedule="cosine")
    _, opt, sched = build_optimizer(cfg, torch.nn.Linear(2, 2))
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] < lrs[1] < lrs[2] == pytest.approx(1.0)  # warm-up, then the peak
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.9)))
    const = TrainConfig(data="x", lr=1.0, warmup=2, max_steps=12)
    _, opt, sched = build_optimizer(const, torch.nn.Linear(2, 2))
    for _ in range(5):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)
