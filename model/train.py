"""Train an MTP model by online self-distillation (paper 3.3, 4.1-4.4).

    python -m model.self_answers --data openai/gsm8k:main --out runs/self_answers/gsm8k.jsonl   # optional
    python -m model.train --base smollm2-135m --data runs/self_answers/gsm8k.jsonl \\
        --output runs/mtp --adapter alora --max-steps 1000 --batch-size 8 --lora-rank 16
    accelerate launch --multi_gpu --num_processes 2 -m model.train ...   # DDP (gloo on a CPU-only machine)

DDP is tested (2 CPU processes, identical weights). FSDP is not: the teacher pass calls the unwrapped
module (peft ``disable_adapter``), which assumes unsharded parameters; use DDP for LoRA / aLoRA.

Each optimizer step draws one block size ``k`` in ``[k_min, k_max]`` and one region-grid offset, lays
out ``--batch-size`` sequences per process with ``M`` MTP regions each
(:mod:`model.layout`), and minimises the student-forced self-distillation loss
(:mod:`model.objective`). Three ways to train:

* ``--adapter full`` (``--lora-rank 0``): every weight trains; the teacher is a frozen copy.
* ``--adapter lora`` (default, ``--lora-rank 16``): LoRA on all linear layers + the mask token's
  embedding row; the teacher is the same module with the adapter disabled.
* ``--adapter alora``: activated LoRA (peft ``alora_invocation_tokens=[mask]``): real tokens use
  the base weights, only mask positions the adapter; two-phase training.

Mixed precision ``auto`` is bf16 autocast wherever the device computes bf16 natively (CUDA; CPUs with
AVX512-BF16 or AMX, :func:`model.precision.native_bf16`), float32 elsewhere.

Outputs in ``--output``: ``train_log.jsonl`` (one JSON object per step), ``checkpoint-STEP/``
(resumable: trainable weights, optimizer, scheduler, RNG, step, training CPU seconds),
``exports/step-N/`` with ``--export-every N``, and the final export: a full model
directory (tokenizer with the mask token) or an adapter directory (``mtp_adapter.json`` +
``mask_rows.safetensors`` + peft files) that :func:`model.checkpoint.load_checkpoint` loads.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .adapter_format import MTPMeta, load_mask_rows, read_meta, save_mtp_checkpoint
from .checkpoint import DEFAULT_MASK_TOKEN, DEFAULT_SOURCE, PROMPT_FORMATS, CheckpointError, LoadedModel, load_checkpoint
from .precision import native_bf16
from .strategies import DEFAULT_K_MAX, MAX_K_MAX
from .layout import build_layout, build_span_layout, default_num_regions, place_regions, sample_block
from .objective import alora_objective, mtp_objective
from .train_data import DataError, Example, encode, load_examples

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
    k_min: int = 2
    num_regions: int | None = None
    spacing: int | None = None
    lr: float = 1e-5
    warmup: int = 2000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adapter: str | None = None
    lora_rank: int = 16
    lora_alpha: float | None = None
    target_modules: str = "all-linear"
    soft_teacher: bool = False
    save_every: int = 500
    keep_checkpoints: int = 2
    compact_checkpoints: bool = False
    resume: str | None = None
    init_adapter: str | None = None
    seed: int = 0
    self_distill_answers: int = 0
    answer_max_new_tokens: int = 256
    answer_batch_size: int = 16
    reference_share: float = 0.0
    max_examples: int | None = None
    data_split: str = "train"
    mixed_precision: str = "auto"
    cpu: bool = False
    threads: int | None = None
    save_dtype: str = "bfloat16"
    log_every: int = 1
    max_minutes: float | None = None
    max_cpu_minutes: float | None = None
    export_every: int = 0
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
        if not 2 <= self.k_min <= self.k_max:
            raise ValueError(f"--k-min must be in [2, --k-max], got {self.k_min}.")
        if not 0.0 <= self.reference_share <= 1.0:
            raise ValueError(f"--reference-share must be in [0, 1], got {self.reference_share}.")
        if self.answer_batch_size < 1 or self.export_every < 0:
            raise ValueError("--answer-batch-size must be ≥ 1 and --export-every ≥ 0.")
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

    targets: Any = cfg.target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    kw: dict[str, Any] = dict(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank, lora_dropout=0.0,
                              target_modules=targets, trainable_token_indices=[mask_id], task_type="CAUSAL_LM")
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
@dataclass
class TrainData:
    """Tokenised training sequences: ``seqs[i]`` (prompt + response + EOS, cut at ``--seq-len``) and
    the index ``starts[i]`` of its first response token."""

    seqs: list[list[int]]
    starts: list[int]

    def __len__(self) -> int:
        return len(self.seqs)


def mix_reference(examples: Sequence[Example], share: float, seed: int) -> list[Example]:
    """Swap a seeded ``share`` of the examples that carry a ``reference`` answer (rows written by
    :mod:`model.self_answers`) to train on that reference instead of the generated response."""
    if share <= 0:
        return list(examples)
    rng = random.Random(f"reference-{seed}")
    return [dataclasses.replace(ex, response=ex.reference, complete=True) if ex.reference and rng.random() < share
            else ex for ex in examples]


def prepare_data(cfg: TrainConfig, lm: LoadedModel, examples: Sequence[Example], accelerator: Any) -> TrainData:
    """Training sequences from the examples: the base model's own greedy answers first when
    ``--self-distill-answers N`` (generated batched by :mod:`model.self_answers` into
    ``OUTPUT/self_answers.jsonl``, on the main process; reused on a rerun), then the reference mix,
    then tokenisation (:func:`model.train_data.encode`)."""
    main = accelerator.is_main_process
    if cfg.self_distill_answers > 0:
        from .self_answers import as_examples, write_answers

        path = Path(cfg.output) / SELF_ANSWERS
        if main:
            bare = accelerator.unwrap_model(lm.model)
            was_training = bare.training
            bare.eval()
            with accelerator.autocast():
                write_answers(lm, examples, path, limit=cfg.self_distill_answers, batch_size=cfg.answer_batch_size,
                              max_new_tokens=cfg.answer_max_new_tokens)
            bare.train(was_training)
        accelerator.wait_for_everyone()
        rows = write_answers(lm, examples, path, limit=cfg.self_distill_answers, show_progress=False)
        examples = as_examples(rows, path)
    examples = mix_reference(examples, cfg.reference_share, cfg.seed)
    seqs, starts, dropped = encode(lm, examples, cfg.seq_len)
    if dropped and main:
        print(f"note: {dropped} examples dropped (prompt longer than --seq-len {cfg.seq_len})", file=sys.stderr)
    return TrainData(seqs, starts)


def batch_indices(step: int, micro: int, rank: int, cfg: TrainConfig, world: int, n: int) -> list[int]:
    """Example indices of one micro-batch on one process: a seeded permutation per epoch, consumed in
    order (global position ``step * per_step + (micro * world + rank) * batch_size``)."""
    per_step = cfg.batch_size * cfg.grad_accum * world
    start = step * per_step + (micro * world + rank) * cfg.batch_size
    out = []
    for g in range(start, start + cfg.batch_size):
        epoch, i = divmod(g, n)
        perm = np.random.default_rng([cfg.seed, epoch]).permutation(n)
        out.append(int(perm[i]))
    return out


# ------------------------------------------------------------------------------ the objective on one batch
def pad_id(lm: LoadedModel) -> int:
    """The padding id of layouts (the tokenizer's pad token, else the model's EOS, else 0)."""
    tok = lm.tokenizer
    if tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    return int(lm.stop_token_ids[0]) if lm.stop_token_ids else 0


class NonFiniteLossError(RuntimeError):
    """A training step produced a non-finite loss or gradient; nothing was updated or written."""


def batch_objective(setup: Setup, model: Any, bare: Any, seqs: Sequence[Sequence[int]], starts: Sequence[int], *,
                    k: int, offset: int, spacing: int, num_regions: int, soft_teacher: bool = False) -> Any | None:
    """Lay out one batch (regions on the grid, :mod:`model.layout`) and evaluate the objective on it
    (:func:`~model.objective.alora_objective` for activated adapters, else
    :func:`~model.objective.mtp_objective`): shared by the training step and the held-out evaluation.

    Args:
        model: the student as called (possibly DDP-wrapped); ``bare``: the unwrapped module.

    Returns:
        The :class:`~model.objective.StepOutput`, or None when the batch holds no region.
    """
    lm = setup.lm
    pad = pad_id(lm)
    # Rows end with the model's first stop token (train_data.encode); a model without one has no EOS
    # rule (no region ever reaches an EOS, so the label used after it never appears).
    eos = int(lm.stop_token_ids[0]) if lm.stop_token_ids else pad
    regions = place_regions(seqs, starts, k=k, offset=offset, spacing=spacing, num_regions=num_regions,
                            eos_token_id=list(lm.stop_token_ids))
    if not regions:
        return None
    layout = build_layout(seqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=pad)
    dev = next(bare.parameters()).device
    ctx = bare.disable_adapter if setup.kind != "full" else None
    if setup.kind == "alora":
        span = build_span_layout(layout, mask_token_id=lm.mask_token_id, pad_token_id=pad).to(dev)
        return alora_objective(model, span, mask_token_id=lm.mask_token_id, eos_token_id=eos, base_context=ctx,
                               soft_teacher=soft_teacher, unwrapped=bare)
    return mtp_objective(model, layout.to(dev), mask_token_id=lm.mask_token_id, eos_token_id=eos,
                         teacher=setup.teacher, teacher_context=ctx, soft_teacher=soft_teacher)


@torch.no_grad()
def heldout_agreement(setup: Setup, student: Any, seqs: Sequence[Sequence[int]], starts: Sequence[int], *,
                      k: int, spacing: int, num_regions: int, batch_size: int, unwrapped: Any) -> dict[str, float]:
    """Teacher agreement and student confidence at mask positions on fixed held-out regions
    (block size ``k``, grid offset 0): the same objective as training, no gradient, no update.

    Returns:
        ``{"agreement_mask", "confidence_mask", "predictions"}`` (means over all mask positions).
    """
    agree = conf = 0.0
    n = 0
    was_training = student.training
    student.eval()
    for i in range(0, len(seqs), batch_size):
        out = batch_objective(setup, unwrapped, unwrapped, list(seqs[i:i + batch_size]), list(starts[i:i + batch_size]),
                              k=k, offset=0, spacing=spacing, num_regions=num_regions)
        if out is None:
            continue
        m = out.block > 0
        agree += float((out.student_tokens == out.labels)[m].float().sum())
        conf += float(out.student_confidence[m].sum())
        n += int(m.sum())
    student.train(was_training)
    return {"agreement_mask": agree / max(n, 1), "confidence_mask": conf / max(n, 1), "predictions": n}


# ------------------------------------------------------------------------------ the run
LOGGED = ("loss", "confidence", "agreement", "confidence_mask", "agreement_mask")


@dataclass
class Run:
    """A prepared run: everything the step, logging and saving need."""

    cfg: TrainConfig
    accelerator: Any
    setup: Setup
    student: Any  # as prepared by accelerate (possibly DDP-wrapped)
    bare: Any  # the unwrapped module
    optimizer: Any
    scheduler: Any
    params: list
    data: TrainData
    num_regions: int
    spacing: int
    output: Path
    step: int = 0
    cpu_seconds: float = 0.0  # training CPU seconds so far (all runs of this output, resumes included)
    heldout: Any = None  # () -> dict, or None

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def per_step(self) -> int:
        """Sequences per optimizer step over all processes."""
        return self.cfg.batch_size * self.cfg.grad_accum * self.accelerator.num_processes

    def log(self, record: dict) -> None:
        """Append one JSON line to ``train_log.jsonl`` (main process)."""
        if self.main:
            with (self.output / LOG_FILE).open("a") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")


def resolve_mixed_precision(cfg: TrainConfig, device: torch.device) -> str:
    """``--mixed-precision`` -> accelerate's value; ``auto`` is bf16 wherever the device computes in
    bf16 natively (CUDA, CPUs with AVX512-BF16 / AMX: :func:`model.precision.native_bf16`), else no."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    return "bf16" if native_bf16(device) else "no"


def build_optimizer(cfg: TrainConfig, student: Any) -> tuple[list, Any, Any]:
    """AdamW (0.9, 0.95) over the trainable parameters and a linear warm-up-then-constant schedule."""
    from transformers import get_constant_schedule_with_warmup

    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    return params, optimizer, get_constant_schedule_with_warmup(optimizer, cfg.warmup)


def prepare_run(cfg: TrainConfig, lm: LoadedModel | None, examples: Sequence[Example] | None) -> Run:
    """Setup phase: read the data (before anything heavy), the accelerator and its precision, the
    model with its trainable parts, the training sequences, the optimizer, the held-out set, and the
    resumed state when ``--resume``."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    output = Path(cfg.output)
    if examples is None:  # read and validate the data before loading anything heavy
        examples = load_examples(cfg.data, need_response=cfg.self_distill_answers <= 0, split=cfg.data_split,
                                 limit=cfg.max_examples)
    on_cpu = cfg.cpu or not torch.cuda.is_available()
    device = torch.device("cpu") if on_cpu else torch.device("cuda")
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state:  # an earlier run in this process (tests): its precision may differ
        AcceleratorState._reset_state()
    # cpu=True also makes a torchrun-style launch (LOCAL_RANK set) use gloo on a machine without CUDA.
    accelerator = Accelerator(mixed_precision=resolve_mixed_precision(cfg, device), step_scheduler_with_optimizer=False,
                              cpu=on_cpu)
    set_seed(cfg.seed)
    setup = load_for_training(cfg, accelerator.device, lm)
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    data = prepare_data(cfg, setup.lm, examples, accelerator)
    params, optimizer, scheduler = build_optimizer(cfg, setup.student)
    student, optimizer, scheduler = accelerator.prepare(setup.student, optimizer, scheduler)
    run = Run(cfg=cfg, accelerator=accelerator, setup=setup, student=student, bare=accelerator.unwrap_model(student),
              optimizer=optimizer, scheduler=scheduler, params=params, data=data,
              num_regions=cfg.num_regions or default_num_regions(cfg.seq_len, cfg.k_max),
              spacing=cfg.spacing or 2 * cfg.k_max, output=output)
    if cfg.eval_examples > 0:
        ev = load_examples(cfg.eval_data or cfg.data, need_response=True, split="test", limit=cfg.eval_examples)
        ev_seqs, ev_starts, _ = encode(setup.lm, ev, cfg.seq_len)
        run.heldout = lambda: heldout_agreement(setup, run.student, ev_seqs, ev_starts, k=cfg.eval_k,
                                                spacing=run.spacing, num_regions=run.num_regions,
                                                batch_size=cfg.batch_size, unwrapped=run.bare)
    if cfg.resume:
        resume_run(run, resolve_resume(cfg.resume, output))
    return run


def train_step(run: Run) -> dict:
    """One optimizer step (``--grad-accum`` micro-batches): draw k and the grid offset, lay out each
    micro-batch, objective, backward, clip, AdamW, schedule. Returns the step's log record."""
    cfg, acc = run.cfg, run.accelerator
    t0, c0 = time.perf_counter(), time.process_time()
    rng = random.Random(f"mtp-{cfg.seed}-{run.step}")  # k and grid offset: same on every process
    k, offset = sample_block(rng, cfg.k_max, run.spacing, k_min=cfg.k_min)
    sums: dict[str, float] = {}
    for micro in range(cfg.grad_accum):
        idx = batch_indices(run.step, micro, acc.process_index, cfg, acc.num_processes, len(run.data))
        sync = contextlib.nullcontext() if micro == cfg.grad_accum - 1 else acc.no_sync(run.student)
        with sync, acc.autocast():
            out = batch_objective(run.setup, run.student, run.bare, [run.data.seqs[i] for i in idx],
                                  [run.data.starts[i] for i in idx], k=k, offset=offset, spacing=run.spacing,
                                  num_regions=run.num_regions, soft_teacher=cfg.soft_teacher)
            if out is None:  # cannot happen (every sequence has a response token), kept for safety
                raise RuntimeError("A training batch without any MTP region.")
            acc.backward(out.loss / cfg.grad_accum)
        for key, v in out.metrics().items():
            sums[key] = sums.get(key, 0.0) + float(v)
    grad_norm = acc.clip_grad_norm_(run.params, cfg.grad_clip)
    bad = torch.tensor([float(not math.isfinite(sums["loss"]) or not math.isfinite(float(grad_norm)))],
                       device=acc.device)
    if float(acc.reduce(bad, reduction="max")) > 0:  # every process stops, before any update
        run.optimizer.zero_grad(set_to_none=True)
        last = _checkpoints(run.output)
        raise NonFiniteLossError(
            f"step {run.step + 1} (k={k}, offset {offset}): non-finite loss or gradient (loss {sums['loss']}, grad "
            f"norm {float(grad_norm)}); nothing was updated. Last resumable checkpoint: "
            f"{last[-1] if last else 'none'}. Lower --lr or use --mixed-precision no, then --resume auto.")
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    vals = torch.tensor([sums[x] / cfg.grad_accum for x in LOGGED], device=acc.device, dtype=torch.float64)
    vals = acc.reduce(vals, reduction="mean")
    seconds = time.perf_counter() - t0
    cpu_seconds = time.process_time() - c0  # this process's CPU time (all threads): load-independent cost
    cpu_seconds = float(acc.reduce(torch.tensor([cpu_seconds], device=acc.device, dtype=torch.float64), reduction="max"))
    run.cpu_seconds += cpu_seconds
    return {"step": run.step, **{x: round(float(v), 6) for x, v in zip(LOGGED, vals.tolist())}, "k": k,
            "offset": offset, "lr": run.scheduler.get_last_lr()[0], "grad_norm": round(float(grad_norm), 6),
            "sequences": run.per_step, "seen": run.step * run.per_step, "seconds": round(seconds, 4),
            "cpu_seconds": round(cpu_seconds, 4), "cpu_total": round(run.cpu_seconds, 2),
            "seqs_per_s": round(run.per_step / seconds, 4), "predictions": int(sums["predictions"]),
            "mixed_precision": acc.mixed_precision}


def _trainable_only(run: Run) -> Any:
    """accelerate save hook: an adapter run's checkpoint holds its trainable weights only (the frozen
    base, ~0.5 GB for SmolLM2, is reloaded from its source on resume)."""
    trainable = {n for n, p in run.bare.named_parameters() if p.requires_grad}

    def hook(models: list, weights: list, output_dir: str) -> None:
        for i, sd in enumerate(weights):
            # names as the prepared module saw them (a DDP wrapper adds "module.")
            weights[i] = {k: v for k, v in sd.items() if k.removeprefix("module.") in trainable}

    return hook


def _compact_optimizer_file(d: Path) -> None:
    """``--compact-checkpoints``: AdamW moments stored in bf16 (half the size; torch casts them back to
    the parameters' dtype on load, so a resume continues closely but not bit for bit)."""
    f = d / "optimizer.bin"
    if not f.is_file():
        return
    sd = torch.load(f, weights_only=False)
    for st in sd.get("state", {}).values():
        for key, v in st.items():
            if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                st[key] = v.to(torch.bfloat16)
    torch.save(sd, f)


def save_checkpoint(run: Run) -> Path:
    """``output/checkpoint-STEP``: accelerate state (weights, optimizer, scheduler, RNG of every
    process) + ``trainer_state.json`` (step, training CPU seconds, config); older checkpoints beyond
    ``--keep-checkpoints`` go. Adapter runs save their trainable weights only (~20 MB + ~40 MB of
    AdamW moments for r16 on SmolLM2; ``--compact-checkpoints``: moments in bf16)."""
    acc, d = run.accelerator, run.output / f"checkpoint-{run.step}"
    handle = acc.register_save_state_pre_hook(_trainable_only(run)) if run.setup.kind != "full" else None
    try:
        acc.save_state(str(d))
    finally:
        if handle is not None:
            handle.remove()
    if run.main and run.cfg.compact_checkpoints:
        _compact_optimizer_file(d)
    if run.main:
        state = {"step": run.step, "cpu_seconds": run.cpu_seconds, "config": asdict(run.cfg)}
        (d / STATE_FILE).write_text(json.dumps(state, indent=1, default=str, allow_nan=False))
        for old in _checkpoints(run.output)[: -run.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return d


def resume_run(run: Run, resume_dir: Path | None) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into the run (nothing when None)."""
    if resume_dir is None:
        return
    # strict=False: an adapter run's checkpoint holds only the trainable weights (_trainable_only).
    run.accelerator.load_state(str(resume_dir), strict=run.setup.kind == "full")
    state = json.loads((resume_dir / STATE_FILE).read_text())
    run.step, run.cpu_seconds = state["step"], float(state.get("cpu_seconds", 0.0))
    if run.main:
        _truncate_log(run.output / LOG_FILE, run.step)
        print(f"resumed from {resume_dir} at step {run.step}", file=sys.stderr)


def _truncate_log(path: Path, step: int) -> None:
    """Drop the log lines of steps after ``step`` (logged by a killed run after its last checkpoint,
    about to be run again), so that the resumed log holds each step once."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    keep = [x for x in lines if not x.strip() or json.loads(x).get("step", 0) <= step or "eval" in json.loads(x)]
    if len(keep) != len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(path)


def export_snapshot(run: Run) -> Path | None:
    """``--export-every``: the model as the final export would be now, in ``exports/step-STEP``
    (a loadable adapter or model directory: a curve of held-out figures against sequences seen)."""
    d = run.output / "exports" / f"step-{run.step}"
    sd = run.accelerator.get_state_dict(run.student) if run.setup.kind == "full" else None
    if run.main:
        export_model(run.cfg, run.setup.lm, run.bare, d, state_dict=sd)
        (d / "trained.json").write_text(json.dumps({"step": run.step, "seen": run.step * run.per_step,
                                                    "cpu_seconds": round(run.cpu_seconds, 2)}, allow_nan=False))
    run.accelerator.wait_for_everyone()
    return d if run.main else None


def _out_of_time(run: Run, started: float) -> str | None:
    """Why the run must stop before ``--max-steps`` (``--max-minutes`` of wall clock in this process,
    ``--max-cpu-minutes`` of training CPU time over all resumes), or None; same answer on every process."""
    cfg = run.cfg
    wall = cfg.max_minutes is not None and time.perf_counter() - started > 60 * cfg.max_minutes
    cpu = cfg.max_cpu_minutes is not None and run.cpu_seconds >= 60 * cfg.max_cpu_minutes
    flags = torch.tensor([float(wall), float(cpu)], device=run.accelerator.device)
    flags = run.accelerator.reduce(flags, reduction="max")
    if float(flags[1]) > 0:
        return f"{cfg.max_cpu_minutes} CPU minutes of training"
    if float(flags[0]) > 0:
        return f"{cfg.max_minutes} minutes"
    return None


def finish(run: Run) -> None:
    """Final held-out evaluation, the export to ``output/final``, and the DDP digest (tests)."""
    if run.heldout is not None and run.main:
        run.log({"eval": "after", "step": run.step, **run.heldout()})
    run.accelerator.wait_for_everyone()
    sd = run.accelerator.get_state_dict(run.student) if run.setup.kind == "full" else None
    if run.main:
        export_model(run.cfg, run.setup.lm, run.bare, run.output / "final", state_dict=sd)
        print(f"saved {run.output / 'final'}", file=sys.stderr)
    if run.cfg.debug_dump_params:
        (run.output / f"params_rank{run.accelerator.process_index}.json").write_text(
            json.dumps({"step": run.step, "sha256": params_digest(run.bare)}, allow_nan=False))
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()


def train(cfg: TrainConfig, *, lm: LoadedModel | None = None, examples: Sequence[Example] | None = None) -> dict:
    """Run (or resume) a training run; returns the last step's logged record.

    Phases: :func:`prepare_run` (data, model, optimizer, resume), then :func:`train_step` until
    ``--max-steps`` or a time budget, logging every ``--log-every`` steps, saving a resumable
    checkpoint every ``--save-every`` (:func:`save_checkpoint`) and an export every ``--export-every``
    (:func:`export_snapshot`), then :func:`finish` (final export).

    Args:
        cfg: the options.
        lm: an in-memory base model (tests); default: ``load_checkpoint(cfg.base)``.
        examples: in-memory examples; default: read ``cfg.data``.

    Raises:
        DataError: bad data (before any training step).
        CheckpointError: unloadable base / adapter.
        ValueError: bad options.
    """
    from tqdm.auto import tqdm

    run = prepare_run(cfg, lm, examples)
    if run.heldout is not None and run.main and run.step == 0:
        run.log({"eval": "before", "step": 0, **run.heldout()})
    started = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=run.step, disable=not run.main, desc=f"MTP {run.setup.kind}",
               dynamic_ncols=True)
    record: dict = {}
    run.student.train()
    stop = _out_of_time(run, started)  # a resumed run may have spent its CPU budget already
    while run.step < cfg.max_steps and stop is None:
        record = train_step(run)
        if run.step % cfg.log_every == 0 or run.step == cfg.max_steps:
            run.log(record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", agree=f"{record['agreement_mask']:.2f}", k=record["k"],
                        seq_s=f"{record['seqs_per_s']:.2f}")
        stop = _out_of_time(run, started) if run.step < cfg.max_steps else None
        if run.step % cfg.save_every == 0 or run.step == cfg.max_steps or stop is not None:
            save_checkpoint(run)
        if cfg.export_every and (run.step % cfg.export_every == 0 or run.step == cfg.max_steps or stop is not None):
            export_snapshot(run)
        if cfg.debug_crash_after_step is not None and run.step == cfg.debug_crash_after_step:
            run.accelerator.wait_for_everyone()
            os.kill(os.getpid(), signal.SIGKILL)  # simulate a killed job (tests of --resume)
    bar.close()
    if stop is not None and run.main:
        print(f"stopping after {stop} at step {run.step}", file=sys.stderr)
    finish(run)
    return record


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
    a("--k-max", type=int, default=d.k_max, help="largest block size; k is drawn from [k_min, k_max] each step")
    a("--k-min", type=int, default=d.k_min, help="smallest block size drawn")
    a("--num-regions", type=int, default=None, help="MTP regions per sequence, M (default N / (2 k_max))")
    a("--spacing", type=int, default=None, help="region grid spacing in tokens (default 2 k_max)")
    a("--lr", type=float, default=d.lr)
    a("--warmup", type=int, default=d.warmup, help="linear warm-up steps, then constant")
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--grad-clip", type=float, default=d.grad_clip)
    a("--adapter", choices=ADAPTERS, default=None, help="default: lora, or full with --lora-rank 0")
    a("--lora-rank", type=int, default=d.lora_rank, help="0 = full fine-tune")
    a("--lora-alpha", type=float, default=None, help="default 2 x rank")
    a("--target-modules", default=d.target_modules,
      help="projections that carry the (a)LoRA adapter: all-linear or names, e.g. q_proj,v_proj,down_proj")
    a("--soft-teacher", action="store_true", help="match the teacher's distribution instead of its argmax")
    a("--save-every", type=int, default=d.save_every, help="steps between resumable checkpoints")
    a("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    a("--compact-checkpoints", action="store_true",
      help="store AdamW moments in bf16 (half the size; resume is close, not bit-exact)")
    a("--resume", default=None, help="checkpoint dir, run dir, or 'auto' (latest in --output)")
    a("--init-adapter", default=None, help="start from a saved lora/alora adapter directory")
    a("--seed", type=int, default=d.seed)
    a("--self-distill-answers", type=int, default=0, metavar="N",
      help="train on the base model's own greedy answers to the first N prompts, generated batched into "
           "OUTPUT/self_answers.jsonl (or generate them beforehand with python -m model.self_answers and pass "
           "that file as --data)")
    a("--answer-max-new-tokens", type=int, default=d.answer_max_new_tokens)
    a("--answer-batch-size", type=int, default=d.answer_batch_size, help="prompts per generate call")
    a("--reference-share", type=float, default=d.reference_share,
      help="with self-answer rows (model.self_answers output): train this share of them on the data's reference answer")
    a("--max-examples", type=int, default=None, help="read at most this many rows")
    a("--mixed-precision", choices=["auto", "no", "bf16", "fp16"], default="auto",
      help="auto: bf16 autocast where the device computes bf16 natively (CUDA; CPUs with AVX512-BF16 or AMX), else float32")
    a("--threads", type=int, default=None,
      help="torch CPU threads per process; 1 is far faster on a CPU shared with other jobs (no OpenMP spin-waits)")
    a("--cpu", action="store_true", help="train on the CPU even when CUDA is present")
    a("--save-dtype", choices=["bfloat16", "float16", "float32"], default=d.save_dtype)
    a("--log-every", type=int, default=d.log_every)
    a("--max-minutes", type=float, default=None, help="stop (and save) after this much wall-clock training time")
    a("--max-cpu-minutes", type=float, default=None,
      help="stop (and save) once the training steps used this much CPU time, counted over resumes (equal-compute comparisons)")
    a("--export-every", type=int, default=0, help="also write a loadable export to OUTPUT/exports/step-N every N steps")
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
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
