"""Train an MTP model by online self-distillation (paper 3.3, 4.1-4.4; DESIGN.md section 2).

    python -m model.train --base smollm2-135m --data ../shared/data/gsm8k/train.jsonl \\
        --output runs/mtp --max-steps 1000 --batch-size 8 --lora-rank 16
    accelerate launch --multi_gpu --num_processes 2 -m model.train ...   # DDP (gloo on a CPU-only machine)

DDP is tested (2 CPU processes, identical weights). FSDP is not: the teacher pass calls the unwrapped
module (peft ``disable_adapter``), which assumes unsharded parameters; use DDP for LoRA / aLoRA.

Each optimizer step draws one block size ``k`` in ``[2, k_max]`` and one region-grid offset, lays
out ``--batch-size`` sequences per process with ``M`` MTP regions each
(:mod:`model.layout`), and minimises the student-forced self-distillation loss
(:mod:`model.objective`). Three ways to train:

* ``--adapter full`` (``--lora-rank 0``): every weight trains; the teacher is a frozen copy.
* ``--adapter lora`` (default, ``--lora-rank 16``): LoRA on all linear layers + the mask token's
  embedding row; the teacher is the same module with the adapter disabled.
* ``--adapter alora``: activated LoRA (peft ``alora_invocation_tokens=[mask]``): real tokens use
  the base weights, only mask positions the adapter; two-phase training (issue 6).

Outputs in ``--output``: ``train_log.jsonl`` (one JSON object per step), ``checkpoint-STEP/``
(resumable: weights, optimizer, scheduler, RNG, step) and the final export: a full model
directory (tokenizer with the mask token) or an adapter directory (``mtp_adapter.json`` +
``mask_rows.safetensors`` + peft files) that :func:`model.checkpoint.load_checkpoint` loads.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .adapter_format import MTPMeta, load_mask_rows, read_meta, save_mtp_checkpoint
from .checkpoint import DEFAULT_MASK_TOKEN, DEFAULT_SOURCE, PROMPT_FORMATS, CheckpointError, LoadedModel, load_checkpoint
from .strategies import DEFAULT_K_MAX, MAX_K_MAX
from .layout import build_layout, build_span_layout, default_num_regions, place_regions, sample_block
from .objective import alora_objective, mtp_objective
from .train_data import DataError, Example, encode, load_examples, read_jsonl, write_jsonl

LOG_FILE = "train_log.jsonl"
STATE_FILE = "trainer_state.json"
SELF_ANSWERS = "self_answers.jsonl"
ADAPTERS = ("full", "lora", "alora")


@dataclass
class TrainConfig:
    """Every option of ``python -m model.train`` (see ``--help`` for each)."""

    base: str = DEFAULT_SOURCE
    data: str = ""
    output: str = "runs/mtp"
    prompt_format: str | None = None
    mask_token: str = DEFAULT_MASK_TOKEN
    max_steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 160
    k_max: int = DEFAULT_K_MAX
    num_regions: int | None = None
    spacing: int | None = None
    lr: float = 1e-5
    warmup: int = 2000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adapter: str | None = None
    lora_rank: int = 16
    lora_alpha: float | None = None
    soft_teacher: bool = False
    save_every: int = 500
    keep_checkpoints: int = 2
    resume: str | None = None
    init_adapter: str | None = None
    seed: int = 0
    self_distill_answers: int = 0
    answer_max_new_tokens: int = 256
    max_examples: int | None = None
    data_split: str = "train"
    mixed_precision: str = "auto"
    cpu: bool = False
    threads: int | None = None
    save_dtype: str = "bfloat16"
    log_every: int = 1
    max_minutes: float | None = None
    eval_data: str | None = None
    eval_examples: int = 0
    eval_k: int = 4
    debug_crash_after_step: int | None = None
    debug_dump_params: bool = False

    @property
    def kind(self) -> str:
        """``full``, ``lora`` or ``alora`` (``--adapter``, else from ``--lora-rank``)."""
        if self.adapter:
            return self.adapter
        return "full" if self.lora_rank == 0 else "lora"

    def validate(self) -> None:
        """Raise ``ValueError`` with a clear message for impossible settings."""
        if self.adapter is not None and self.adapter not in ADAPTERS:
            raise ValueError(f"--adapter must be one of {ADAPTERS}, got {self.adapter!r}.")
        if self.kind in ("lora", "alora") and self.lora_rank < 1:
            raise ValueError(f"--adapter {self.kind} needs --lora-rank ≥ 1.")
        for name in ("max_steps", "batch_size", "grad_accum", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1.")
        if not 2 <= self.k_max <= MAX_K_MAX:
            raise ValueError(f"--k-max must be in [2, {MAX_K_MAX}], got {self.k_max}.")
        if self.seq_len < 4:
            raise ValueError("--seq-len must be ≥ 4.")
        if self.warmup < 0 or self.lr <= 0:
            raise ValueError("--lr must be > 0 and --warmup ≥ 0.")
        if self.prompt_format is not None and self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"--prompt-format must be one of {PROMPT_FORMATS}.")
        if not self.data:
            raise ValueError("--data is required (a JSONL file or a datasets id).")


# ------------------------------------------------------------------------------ model setup
@dataclass
class Setup:
    """The student (trainable module), how to get the teacher, and the loaded model's metadata."""

    lm: LoadedModel
    student: Any
    teacher: Any | None
    teacher_context: Any | None
    kind: str


def _lora_config(cfg: TrainConfig, mask_id: int, alora: bool) -> Any:
    from peft import LoraConfig

    kw: dict[str, Any] = dict(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank, lora_dropout=0.0,
                              target_modules="all-linear", trainable_token_indices=[mask_id], task_type="CAUSAL_LM")
    if alora:
        kw["alora_invocation_tokens"] = [mask_id]
    return LoraConfig(**kw)


def load_for_training(cfg: TrainConfig, device: torch.device, lm: LoadedModel | None = None) -> Setup:
    """Load the base (through :func:`load_checkpoint`, no second loader), add the mask token, attach
    the trainable parts. With ``--init-adapter DIR`` the adapter (and mask rows) of DIR are loaded
    trainable on top of the base that DIR names.

    Raises:
        CheckpointError: unloadable base or adapter; an adapter kind that does not match ``--adapter``.
    """
    from peft import PeftModel, get_peft_model

    kind = cfg.kind
    init_meta = None
    if cfg.init_adapter:
        init_meta = read_meta(cfg.init_adapter)
        if init_meta.adapter != kind:
            raise CheckpointError(f"--init-adapter {cfg.init_adapter} holds a {init_meta.adapter!r} adapter "
                                  f"but this run trains --adapter {kind}.")
    if lm is None:
        base = init_meta.base if init_meta else cfg.base
        lm = load_checkpoint(base, mask_token=init_meta.mask_token if init_meta else cfg.mask_token, device=device,
                             dtype=torch.float32, prompt_format=cfg.prompt_format or (init_meta.prompt_format if init_meta else None),
                             adapter=False)
    model = lm.model
    if lm.adapter is not None:
        raise CheckpointError("Train from a base model (or pass its adapter with --init-adapter), not a loaded adapter.")
    if kind == "full":
        if init_meta:
            raise CheckpointError("--init-adapter applies to lora/alora runs; for full fine-tuning pass the model "
                                  "directory as --base.")
        teacher = copy.deepcopy(model).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        model.train()
        for p in model.parameters():
            p.requires_grad_(True)
        return Setup(lm, model, teacher, None, kind)
    if init_meta:
        load_mask_rows(model, cfg.init_adapter, lm.mask_token_id)
        peft_model = PeftModel.from_pretrained(model, cfg.init_adapter, is_trainable=True)
    else:
        peft_model = get_peft_model(model, _lora_config(cfg, lm.mask_token_id, kind == "alora"))
    peft_model.to(device)
    peft_model.train()
    lm.model = peft_model
    lm.adapter = kind
    return Setup(lm, peft_model, None, peft_model.disable_adapter, kind)


# ------------------------------------------------------------------------------ saving
def export_model(cfg: TrainConfig, lm: LoadedModel, model: Any, out_dir: str | Path,
                 state_dict: dict | None = None) -> Path:
    """Write the trained model with :func:`model.adapter_format.save_mtp_checkpoint`, so that
    ``load_checkpoint(out_dir)`` decodes it (weights in ``--save-dtype``)."""
    if cfg.init_adapter:
        base = read_meta(cfg.init_adapter).base
    else:
        p = Path(os.path.expanduser(cfg.base))
        base = str(p.resolve()) if p.exists() else cfg.base
    meta = MTPMeta(base=base, adapter=cfg.kind, mask_token=cfg.mask_token, prompt_format=lm.prompt_format,
                   k_max=cfg.k_max)
    return save_mtp_checkpoint(out_dir, model, meta, mask_token_id=lm.mask_token_id, tokenizer=lm.tokenizer,
                               save_dtype=getattr(torch, cfg.save_dtype), state_dict=state_dict)


def _checkpoints(output: Path) -> list[Path]:
    found = [p for p in output.glob("checkpoint-*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def resolve_resume(resume: str, output: Path) -> Path | None:
    """``--resume`` value -> a checkpoint directory (``auto``/an output dir: its latest checkpoint).

    Raises:
        ValueError: a path that holds no resumable checkpoint.
    """
    if resume == "auto":
        cps = _checkpoints(output)
        return cps[-1] if cps else None
    p = Path(resume)
    if (p / STATE_FILE).is_file():
        return p
    cps = _checkpoints(p) if p.is_dir() else []
    if cps:
        return cps[-1]
    raise ValueError(f"--resume {resume}: no checkpoint-*/{STATE_FILE} there. To start from a shipped adapter "
                     "use --init-adapter DIR.")


def params_digest(model: Any) -> str:
    """SHA-256 over every parameter's bytes (name order): equal digests = identical weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda x: x[0]):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------ data
def self_distill_answers(lm: LoadedModel, examples: Sequence[Example], path: Path, n: int,
                         max_new_tokens: int = 256, show_progress: bool = True) -> list[Example]:
    """The base model's own greedy answers (``model.decoding``'s standard strategy) to the first
    ``n`` prompts, appended to ``path`` (JSONL ``prompt``/``response``); rows already there are reused,
    so an interrupted run continues where it stopped. Empty answers (an immediate EOS) are kept in
    the file but not returned."""
    from tqdm.auto import tqdm

    from .decoding import Decoder, standard

    rows: list[dict] = []
    if path.is_file():
        rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    todo = list(examples[len(rows):n])
    with lm.base_model(), path.open("a", encoding="utf-8") as f:
        for ex in tqdm(todo, desc="self-distill answers", disable=not show_progress or not todo):
            dec = Decoder(lm, lm.prompt_ids(ex.prompt), standard(), max_new_tokens)
            for _ in dec:
                pass
            text = lm.tokenizer.decode(dec.result().token_ids, skip_special_tokens=True).strip()
            row = {"prompt": ex.prompt, "response": text}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            rows.append(row)
    out = [Example(r["prompt"], r["response"], f"{path}:{i + 1}") for i, r in enumerate(rows[:n]) if r["response"]]
    if not out:
        raise DataError(f"{path}: the base model answered every prompt with nothing; no training text.")
    return out


def batch_indices(step: int, micro: int, rank: int, cfg: TrainConfig, world: int, n: int) -> list[int]:
    """Example indices of one micro-batch on one process: a seeded permutation per epoch, consumed in
    order (deterministic from the step alone, so resuming needs no data-loader state)."""
    per_step = cfg.batch_size * cfg.grad_accum * world
    start = step * per_step + (micro * world + rank) * cfg.batch_size
    out = []
    for g in range(start, start + cfg.batch_size):
        epoch, i = divmod(g, n)
        perm = np.random.default_rng([cfg.seed, epoch]).permutation(n)
        out.append(int(perm[i]))
    return out


# ------------------------------------------------------------------------------ held-out agreement
@torch.no_grad()
def heldout_agreement(setup: Setup, student: Any, seqs: Sequence[Sequence[int]], starts: Sequence[int], *,
                      k: int, spacing: int, num_regions: int, batch_size: int, unwrapped: Any) -> dict[str, float]:
    """Teacher agreement and student confidence at mask positions on fixed held-out regions
    (block size ``k``, grid offset 0): the same objective as training, no gradient, no update.

    Returns:
        ``{"agreement_mask", "confidence_mask", "predictions"}`` (means over all mask positions).
    """
    lm = setup.lm
    eos = lm.tokenizer.eos_token_id
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else eos
    ctx = unwrapped.disable_adapter if setup.kind != "full" else None
    agree = conf = 0.0
    n = 0
    was_training = student.training
    student.eval()
    for i in range(0, len(seqs), batch_size):
        bs, bst = list(seqs[i:i + batch_size]), list(starts[i:i + batch_size])
        regions = place_regions(bs, bst, k=k, offset=0, spacing=spacing, num_regions=num_regions, eos_token_id=eos)
        if not regions:
            continue
        layout = build_layout(bs, regions, mask_token_id=lm.mask_token_id, pad_token_id=pad)
        dev = next(unwrapped.parameters()).device
        if setup.kind == "alora":
            span = build_span_layout(layout, mask_token_id=lm.mask_token_id, pad_token_id=pad).to(dev)
            out = alora_objective(unwrapped, span, mask_token_id=lm.mask_token_id, eos_token_id=eos, base_context=ctx)
        else:
            out = mtp_objective(unwrapped, layout.to(dev), mask_token_id=lm.mask_token_id, eos_token_id=eos,
                                teacher=setup.teacher, teacher_context=ctx)
        m = out.block > 0
        agree += float((out.student_tokens == out.labels)[m].float().sum())
        conf += float(out.student_confidence[m].sum())
        n += int(m.sum())
    student.train(was_training)
    return {"agreement_mask": agree / max(n, 1), "confidence_mask": conf / max(n, 1), "predictions": n}


# ------------------------------------------------------------------------------ training loop
def train(cfg: TrainConfig, *, lm: LoadedModel | None = None, examples: Sequence[Example] | None = None) -> dict:
    """Run (or resume) a training run; returns the last step's logged record.

    Args:
        cfg: the options.
        lm: an in-memory base model (tests); default: ``load_checkpoint(cfg.base)``.
        examples: in-memory examples; default: read ``cfg.data``.

    Raises:
        DataError: bad data (before any training step).
        CheckpointError: unloadable base / adapter.
        ValueError: bad options.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_constant_schedule_with_warmup

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    output = Path(cfg.output)
    need_resp = cfg.self_distill_answers <= 0
    if examples is None:  # read and validate the data before loading anything heavy
        examples = load_examples(cfg.data, need_response=need_resp, split=cfg.data_split, limit=cfg.max_examples)
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() else "no"
    # cpu=True also makes a torchrun-style launch (LOCAL_RANK set) use gloo on a machine without CUDA.
    accelerator = Accelerator(mixed_precision=mp, step_scheduler_with_optimizer=False,
                              cpu=cfg.cpu or not torch.cuda.is_available())
    main = accelerator.is_main_process
    set_seed(cfg.seed)
    setup = load_for_training(cfg, accelerator.device, lm)
    lm = setup.lm
    if main:
        output.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()

    if cfg.self_distill_answers > 0:
        path = output / SELF_ANSWERS
        if main:
            with torch.no_grad():
                self_distill_answers(lm, examples, path, cfg.self_distill_answers, cfg.answer_max_new_tokens)
        accelerator.wait_for_everyone()
        examples = self_distill_answers(lm, examples, path, cfg.self_distill_answers, show_progress=False)
    seqs, starts, dropped = encode(lm, examples, cfg.seq_len)
    if dropped and main:
        print(f"note: {dropped} examples dropped (prompt longer than --seq-len {cfg.seq_len})", file=sys.stderr)

    params = [p for p in setup.student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    scheduler = get_constant_schedule_with_warmup(optimizer, cfg.warmup)
    student, optimizer, scheduler = accelerator.prepare(setup.student, optimizer, scheduler)
    bare = accelerator.unwrap_model(student)
    teacher_context = bare.disable_adapter if setup.kind != "full" else None

    num_regions = cfg.num_regions or default_num_regions(cfg.seq_len, cfg.k_max)
    spacing = cfg.spacing or 2 * cfg.k_max
    log_path = output / LOG_FILE
    heldout = None
    if cfg.eval_examples > 0:
        ev = load_examples(cfg.eval_data or cfg.data, need_response=True, split="test", limit=cfg.eval_examples)
        ev_seqs, ev_starts, _ = encode(lm, ev, cfg.seq_len)

        def heldout() -> dict:
            return heldout_agreement(setup, student, ev_seqs, ev_starts, k=cfg.eval_k, spacing=spacing,
                                     num_regions=num_regions, batch_size=cfg.batch_size, unwrapped=bare)

    step = 0
    resume_dir = resolve_resume(cfg.resume, output) if cfg.resume else None
    if resume_dir is not None:
        accelerator.load_state(str(resume_dir))
        step = json.loads((resume_dir / STATE_FILE).read_text())["step"]
        if main:
            print(f"resumed from {resume_dir} at step {step}", file=sys.stderr)

    if heldout is not None and main and step == 0:
        with log_path.open("a") as f:
            f.write(json.dumps({"eval": "before", "step": step, **heldout()}) + "\n")
    eos = lm.tokenizer.eos_token_id
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else eos
    world, rank = accelerator.num_processes, accelerator.process_index
    per_step = cfg.batch_size * cfg.grad_accum * world
    started = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not main, desc=f"MTP {setup.kind}", dynamic_ncols=True)
    record: dict = {}
    student.train()
    while step < cfg.max_steps:
        t0, c0 = time.perf_counter(), time.process_time()
        rng = random.Random(f"mtp-{cfg.seed}-{step}")  # k and grid offset: same on every process
        k, offset = sample_block(rng, cfg.k_max, spacing)
        sums: dict[str, float] = {}
        for micro in range(cfg.grad_accum):
            idx = batch_indices(step, micro, rank, cfg, world, len(seqs))
            bseqs, bstarts = [seqs[i] for i in idx], [starts[i] for i in idx]
            regions = place_regions(bseqs, bstarts, k=k, offset=offset, spacing=spacing, num_regions=num_regions,
                                    eos_token_id=eos)
            layout = build_layout(bseqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=pad)
            sync = contextlib.nullcontext() if micro == cfg.grad_accum - 1 else accelerator.no_sync(student)
            with sync, accelerator.autocast():
                if setup.kind == "alora":
                    span = build_span_layout(layout, mask_token_id=lm.mask_token_id, pad_token_id=pad)
                    out = alora_objective(student, span.to(accelerator.device), mask_token_id=lm.mask_token_id,
                                          eos_token_id=eos, base_context=teacher_context,
                                          soft_teacher=cfg.soft_teacher, unwrapped=bare)
                else:
                    out = mtp_objective(student, layout.to(accelerator.device), mask_token_id=lm.mask_token_id,
                                        eos_token_id=eos, teacher=setup.teacher, teacher_context=teacher_context,
                                        soft_teacher=cfg.soft_teacher)
                accelerator.backward(out.loss / cfg.grad_accum)
            for key, v in out.metrics().items():
                sums[key] = sums.get(key, 0.0) + float(v)
        grad_norm = accelerator.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        keys = ["loss", "confidence", "agreement", "confidence_mask", "agreement_mask"]
        vals = torch.tensor([sums[x] / cfg.grad_accum for x in keys], device=accelerator.device, dtype=torch.float64)
        vals = accelerator.reduce(vals, reduction="mean")
        seconds = time.perf_counter() - t0
        cpu_seconds = time.process_time() - c0  # this process's CPU time (all threads): load-independent cost
        record = {"step": step, **{x: round(float(v), 6) for x, v in zip(keys, vals.tolist())}, "k": k,
                  "offset": offset, "lr": scheduler.get_last_lr()[0], "grad_norm": round(float(grad_norm), 6),
                  "sequences": per_step, "seconds": round(seconds, 4), "cpu_seconds": round(cpu_seconds, 4),
                  "seqs_per_s": round(per_step / seconds, 4),
                  "predictions": int(sums["predictions"])}
        if main and (step % cfg.log_every == 0 or step == cfg.max_steps):
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", agree=f"{record['agreement_mask']:.2f}", k=k,
                        seq_s=f"{record['seqs_per_s']:.2f}")
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save_checkpoint(accelerator, cfg, output, step)
        if cfg.debug_crash_after_step is not None and step == cfg.debug_crash_after_step:
            accelerator.wait_for_everyone()
            os.kill(os.getpid(), signal.SIGKILL)  # simulate a killed job (tests of --resume)
        if cfg.max_minutes is not None and step < cfg.max_steps:
            over = torch.tensor([float(time.perf_counter() - started > 60 * cfg.max_minutes)], device=accelerator.device)
            if float(accelerator.reduce(over, reduction="max")) > 0:
                save_checkpoint(accelerator, cfg, output, step)
                if main:
                    print(f"stopping after {cfg.max_minutes} minutes at step {step}", file=sys.stderr)
                break
    bar.close()
    if heldout is not None and main:
        with log_path.open("a") as f:
            f.write(json.dumps({"eval": "after", "step": step, **heldout()}) + "\n")
    accelerator.wait_for_everyone()
    if setup.kind == "full":
        sd = accelerator.get_state_dict(student)
    else:
        sd = None
    if main:
        export_model(cfg, lm, bare, output / "final", state_dict=sd)
        print(f"saved {output / 'final'}", file=sys.stderr)
    if cfg.debug_dump_params:
        (output / f"params_rank{rank}.json").write_text(json.dumps({"step": step, "sha256": params_digest(bare)}))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return record


def save_checkpoint(accelerator: Any, cfg: TrainConfig, output: Path, step: int) -> Path:
    """``output/checkpoint-STEP``: accelerate state (weights, optimizer, scheduler, RNG of every
    process) + ``trainer_state.json`` (step, config); older checkpoints beyond ``--keep-checkpoints`` go."""
    d = output / f"checkpoint-{step}"
    accelerator.save_state(str(d))
    if accelerator.is_main_process:
        (d / STATE_FILE).write_text(json.dumps({"step": step, "config": asdict(cfg)}, indent=1, default=str))
        for old in _checkpoints(output)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return d


# ------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m model.train", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--base", default=d.base, help="smollm2-135m, a local HF model directory, a .gguf file or a hub id")
    a("--data", required=True, help="JSONL with question/answer or prompt/response rows, or a datasets id")
    a("--data-split", default=d.data_split, help="split for a datasets id")
    a("--output", default=d.output, help="run directory (log, checkpoints, final export)")
    a("--prompt-format", choices=PROMPT_FORMATS, default=None, help="default: chat if the tokenizer has a template")
    a("--mask-token", default=d.mask_token)
    a("--max-steps", type=int, default=d.max_steps, help="optimizer steps")
    a("--batch-size", type=int, default=d.batch_size, help="sequences per process per micro-batch")
    a("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    a("--seq-len", type=int, default=d.seq_len, help="ground-truth tokens per sequence (prompt included), N")
    a("--k-max", type=int, default=d.k_max, help="largest block size; k is drawn from [2, k_max] each step")
    a("--num-regions", type=int, default=None, help="MTP regions per sequence, M (default N / (2 k_max))")
    a("--spacing", type=int, default=None, help="region grid spacing in tokens (default 2 k_max)")
    a("--lr", type=float, default=d.lr)
    a("--warmup", type=int, default=d.warmup, help="linear warm-up steps, then constant")
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--grad-clip", type=float, default=d.grad_clip)
    a("--adapter", choices=ADAPTERS, default=None, help="default: lora, or full with --lora-rank 0")
    a("--lora-rank", type=int, default=d.lora_rank, help="0 = full fine-tune")
    a("--lora-alpha", type=float, default=None, help="default 2 x rank")
    a("--soft-teacher", action="store_true", help="match the teacher's distribution instead of its argmax")
    a("--save-every", type=int, default=d.save_every, help="steps between resumable checkpoints")
    a("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    a("--resume", default=None, help="checkpoint dir, run dir, or 'auto' (latest in --output)")
    a("--init-adapter", default=None, help="start from a saved lora/alora adapter directory")
    a("--seed", type=int, default=d.seed)
    a("--self-distill-answers", type=int, default=0, metavar="N",
      help="train on the base model's own greedy answers to the first N prompts (written to OUTPUT/self_answers.jsonl)")
    a("--answer-max-new-tokens", type=int, default=d.answer_max_new_tokens)
    a("--max-examples", type=int, default=None, help="read at most this many rows")
    a("--mixed-precision", choices=["auto", "no", "bf16", "fp16"], default="auto", help="auto: bf16 on CUDA")
    a("--threads", type=int, default=None,
      help="torch CPU threads per process; 1 is far faster on a CPU shared with other jobs (no OpenMP spin-waits)")
    a("--cpu", action="store_true", help="train on the CPU even when CUDA is present")
    a("--save-dtype", choices=["bfloat16", "float16", "float32"], default=d.save_dtype)
    a("--log-every", type=int, default=d.log_every)
    a("--max-minutes", type=float, default=None, help="stop (and save) after this much wall-clock training time")
    a("--eval-data", default=None, help="held-out JSONL: teacher agreement at mask positions before and after training")
    a("--eval-examples", type=int, default=0, help="held-out sequences to score (0 = no evaluation)")
    a("--eval-k", type=int, default=d.eval_k, help="block size of the held-out evaluation")
    a("--debug-crash-after-step", type=int, default=None, help=argparse.SUPPRESS)
    a("--debug-dump-params", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad options or data)."""
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items()})
    try:
        train(cfg)
    except (DataError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
