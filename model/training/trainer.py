"""The training run: online self-distillation of an MTP model (paper 3.3, 4.1-4.4).

Each optimizer step draws one block size ``k`` in ``[k_min, k_max]`` and one region-grid offset, lays
out ``--batch-size`` sequences per process with ``M`` MTP regions each
(:mod:`model.training.layout`), and minimises the student-forced self-distillation loss
(:mod:`model.training.objective`). Three ways to train:

* ``--adapter full`` (``--lora-rank 0``): every weight trains; the teacher is a frozen copy.
* ``--adapter lora`` (default, ``--lora-rank 16``): LoRA on all linear layers + the mask token's
  embedding row; the teacher is the same module with the adapter disabled.
* ``--adapter alora``: activated LoRA (peft ``alora_invocation_tokens=[mask]``): real tokens use
  the base weights, only mask positions the adapter; two-phase training.

Phases: :func:`prepare_run` (data, model, optimizer, resume), :func:`train_step` until ``--max-steps``
or a time budget, :func:`save_checkpoint` / :func:`export_snapshot` along the way, :func:`finish`.
Mixed precision ``auto`` is bf16 autocast wherever the device computes bf16 natively. DDP runs under
``accelerate launch`` (tested with 2 CPU processes). ``accelerate launch --use_fsdp`` shards a full
fine-tune with torch's FSDP2 on any device (:mod:`model.training.fsdp`; tested with 2 CPU processes);
it is refused at start for LoRA / aLoRA, whose teacher is the student with its adapter disabled
(peft cannot switch an adapter off inside sharded modules): :func:`check_fsdp`.

Outputs in ``--output``: ``train_log.jsonl`` (one JSON object per step, plus ``event`` lines: the
data, skipped batches, evaluations), ``checkpoint-STEP/`` (resumable: trainable weights, optimizer,
scheduler, RNG, step, training CPU seconds), ``exports/step-N/`` with ``--export-every N``, and the
final export: a full model directory (tokenizer with the mask token) or an adapter directory
(``mtp_adapter.json`` + ``mask_rows.safetensors`` + peft files) that
:func:`model.engine.loading.load_checkpoint` loads.
"""

from __future__ import annotations

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

from ..engine.adapter_format import MTPMeta, load_mask_rows, read_meta, save_mtp_checkpoint
from ..engine.loaded_model import LoadedModel
from ..engine.loading import load_checkpoint, peft_quiet, resolve_device
from ..engine.precision import native_bf16
from ..errors import CheckpointError, NonFiniteLossError
from .config import DEFAULT_LORA_RANK, TrainConfig
from .data import Example, encode, load_examples
from . import fsdp
from .layout import default_num_regions, sample_block
from .heldout import score_agreement
from .objective import Setup, batch_objective

LOG_FILE = "train_log.jsonl"
STATE_FILE = "trainer_state.json"
SELF_ANSWERS = "self_answers.jsonl"


# ------------------------------------------------------------------------------ model setup
def _lora_config(cfg: TrainConfig, mask_id: int, alora: bool) -> Any:
    from peft import LoraConfig

    targets: Any = cfg.target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    rank = cfg.lora_rank or DEFAULT_LORA_RANK
    kw: dict[str, Any] = dict(r=rank, lora_alpha=cfg.lora_alpha or 2 * rank, lora_dropout=0.0,
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
        return Setup(lm, model, teacher, kind)
    if init_meta:
        load_mask_rows(model, cfg.init_adapter, lm.mask_token_id)
        with peft_quiet():
            peft_model = PeftModel.from_pretrained(model, cfg.init_adapter, is_trainable=True)
        if cfg.lora_rank is not None:
            grow_rank(peft_model, cfg.lora_rank, seed=cfg.seed)
    else:
        with peft_quiet():
            peft_model = get_peft_model(model, _lora_config(cfg, lm.mask_token_id, kind == "alora"))
    peft_model.to(device)
    peft_model.train()
    lm.model = peft_model
    lm.adapter = kind
    return Setup(lm, peft_model, None, kind)


@torch.no_grad()
def grow_rank(peft_model: Any, rank: int, *, seed: int = 0) -> int:
    """Grow every LoRA module of the active adapter to ``rank`` without changing what it computes.

    The new rows of ``A`` are drawn as peft initialises ``A`` (Kaiming-uniform, seeded); the new columns
    of ``B`` are zero, so ``B A`` is unchanged. peft scales ``B A`` by ``alpha / r``: alpha grows with r
    so the scaling stays, and the config's rank and alpha are updated (an export saves the grown
    adapter). The adapter's own rank does nothing.

    Raises:
        CheckpointError: a rank below the adapter's, or an adapter with per-module ranks.

    Returns:
        The adapter's rank after the call.
    """
    name = peft_model.active_adapter
    cfg = peft_model.peft_config[name]
    old = int(cfg.r)
    if rank < old:
        raise CheckpointError(f"--lora-rank {rank} is below the adapter's rank {old}: an adapter can grow, not shrink.")
    if rank == old:
        return old
    if cfg.rank_pattern or cfg.alpha_pattern:
        raise CheckpointError("--lora-rank cannot grow an adapter with per-module ranks (rank_pattern).")
    gen = torch.Generator().manual_seed(seed)
    for mod in peft_model.modules():
        if not (hasattr(mod, "lora_A") and name in mod.lora_A):
            continue
        a, b = mod.lora_A[name], mod.lora_B[name]
        new_a = torch.empty(rank, a.in_features, dtype=a.weight.dtype)
        torch.nn.init.kaiming_uniform_(new_a, a=math.sqrt(5), generator=gen)
        new_a[:old] = a.weight.detach().cpu()
        new_b = torch.zeros(b.out_features, rank, dtype=b.weight.dtype)
        new_b[:, :old] = b.weight.detach().cpu()
        a.weight = torch.nn.Parameter(new_a.to(a.weight.device), requires_grad=a.weight.requires_grad)
        b.weight = torch.nn.Parameter(new_b.to(b.weight.device), requires_grad=b.weight.requires_grad)
        a.out_features, b.in_features = rank, rank
        mod.r[name] = rank
        mod.lora_alpha[name] = mod.lora_alpha[name] * rank / old  # scaling = alpha / r stays
    cfg.lora_alpha = cfg.lora_alpha * rank / old
    cfg.r = rank
    return rank


# ------------------------------------------------------------------------------ saving
def export_model(cfg: TrainConfig, lm: LoadedModel, model: Any, out_dir: str | Path,
                 state_dict: dict | None = None) -> Path:
    """Write the trained model with :func:`model.engine.adapter_format.save_mtp_checkpoint`, so that
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
    return state_digest(dict(model.named_parameters()))


def state_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over named tensors' float32 bytes, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(tensors.items(), key=lambda x: x[0]):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _full_weights(run: Run) -> dict | None:
    """A full fine-tune's whole weights for an export (process 0; a collective under DDP and FSDP);
    None for adapters (the export reads the adapter from the module)."""
    if run.setup.kind != "full":
        return None
    if run.sharded:
        return fsdp.full_model_state(run.student)
    return run.accelerator.get_state_dict(run.student)


# ------------------------------------------------------------------------------ data
@dataclass
class TrainData:
    """Tokenised training sequences: ``seqs[i]`` (prompt + response + EOS, cut at ``--seq-len``), the
    index ``starts[i]`` of its first response token, and the rows skipped (``"file:line: why"``)."""

    seqs: list[list[int]]
    starts: list[int]
    skipped: list[str] = dataclasses.field(default_factory=list)

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
    then tokenisation (:func:`model.training.data.encode`)."""
    main = accelerator.is_main_process
    if cfg.self_distill_answers > 0:
        from .self_answers import as_examples, write_answers

        path = Path(cfg.output) / SELF_ANSWERS
        if main:
            unwrapped = accelerator.unwrap_model(lm.model)
            was_training = unwrapped.training
            unwrapped.eval()
            with accelerator.autocast():
                write_answers(lm, examples, path, limit=cfg.self_distill_answers, batch_size=cfg.answer_batch_size,
                              max_new_tokens=cfg.answer_max_new_tokens)
            unwrapped.train(was_training)
        accelerator.wait_for_everyone()
        rows = write_answers(lm, examples, path, limit=cfg.self_distill_answers, show_progress=False)
        examples = as_examples(rows, path)
    examples = mix_reference(examples, cfg.reference_share, cfg.seed)
    seqs, starts, dropped = encode(lm, examples, cfg.seq_len)
    if dropped and main:
        shown = "".join(f"\n  {d}" for d in dropped[:5]) + (f"\n  ... and {len(dropped) - 5} more" if len(dropped) > 5 else "")
        print(f"note: {len(dropped)} of {len(examples)} examples skipped, their prompt fills --seq-len "
              f"{cfg.seq_len}:{shown}", file=sys.stderr)
    return TrainData(seqs, starts, dropped)


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
# ------------------------------------------------------------------------------ the run
LOGGED = ("loss", "confidence", "agreement", "confidence_mask", "agreement_mask")


@dataclass
class Run:
    """A prepared run: everything the step, logging and saving need."""

    cfg: TrainConfig
    accelerator: Any
    setup: Setup
    student: Any  # as prepared by accelerate (possibly DDP-wrapped)
    unwrapped: Any  # the plain module
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
    sharded: bool = False  # FSDP: student and teacher sharded over the processes (model.training.fsdp)

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
    bf16 natively (CUDA, CPUs with AVX512-BF16 / AMX: :func:`model.engine.precision.native_bf16`), else no."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    return "bf16" if native_bf16(device) else "no"


def build_optimizer(cfg: TrainConfig, student: Any) -> tuple[list, Any, Any]:
    """AdamW (0.9, 0.95) over the trainable parameters; a linear warm-up, then a constant rate (the
    paper's) or a cosine decay to 10% of ``--lr`` at ``--max-steps`` (``--lr-schedule cosine``)."""
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    warmup, total, cosine = cfg.warmup, cfg.max_steps, cfg.lr_schedule == "cosine"

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if not cosine:
            return 1.0
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * done))

    return params, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def check_fsdp(cfg: TrainConfig, sharded: bool) -> None:
    """Refuse, before anything loads, an FSDP launch (``accelerate launch --use_fsdp``) that cannot work:
    LoRA / aLoRA, whose teacher is the student with its adapter switched off, which peft cannot do inside
    sharded modules. Full fine-tunes shard on any device (:mod:`model.training.fsdp`).

    Raises:
        ValueError: saying what to launch instead.
    """
    if sharded and cfg.kind != "full":
        raise ValueError(f"FSDP trains full fine-tunes only: with --adapter {cfg.kind} the teacher is the student "
                         "with its adapter switched off, which peft cannot do inside sharded modules. Launch "
                         "with DDP (accelerate launch --multi_gpu ...) or use --adapter full (--lora-rank 0).")


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
    device = resolve_device(cfg.device)
    sharded = fsdp.take_request()  # before anything loads: transformers reads the same flag when loading
    check_fsdp(cfg, sharded)
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state:  # an earlier run in this process (tests): its precision may differ
        AcceleratorState._reset_state()
    # cpu=True also makes a torchrun-style launch (LOCAL_RANK set) use gloo on a machine without CUDA.
    accelerator = Accelerator(mixed_precision=resolve_mixed_precision(cfg, device), step_scheduler_with_optimizer=False,
                              cpu=device.type == "cpu")
    set_seed(cfg.seed)
    setup = load_for_training(cfg, accelerator.device, lm)
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    data = prepare_data(cfg, setup.lm, examples, accelerator)
    if sharded:  # FSDP2 by the trainer itself: accelerate only runs the processes (model.training.fsdp)
        fsdp.shard(setup.student)
        fsdp.shard(setup.teacher)
    params, optimizer, scheduler = build_optimizer(cfg, setup.student)
    if sharded:
        student = setup.student
    else:
        student, optimizer, scheduler = accelerator.prepare(setup.student, optimizer, scheduler)
    run = Run(cfg=cfg, accelerator=accelerator, setup=setup, student=student, unwrapped=accelerator.unwrap_model(student),
              optimizer=optimizer, scheduler=scheduler, params=params, data=data,
              num_regions=cfg.num_regions or default_num_regions(cfg.seq_len, cfg.k_max),
              spacing=cfg.spacing or 2 * cfg.k_max, output=output, sharded=sharded)
    if run.main and data.skipped and run.step == 0 and not cfg.resume:  # what the data lost, once, in the log
        run.log({"event": "data", "sequences": len(data), "skipped": len(data.skipped),
                 "skipped_rows": data.skipped[:20]})
    if cfg.eval_examples > 0:
        ev = load_examples(cfg.eval_data or cfg.data, need_response=True, split="test", limit=cfg.eval_examples)
        ev_seqs, ev_starts, _ = encode(setup.lm, ev, cfg.seq_len)

        def heldout() -> dict:
            res = score_agreement(setup, run.unwrapped, ev_seqs, ev_starts, k=cfg.eval_k, spacing=run.spacing,
                                  num_regions=run.num_regions, batch_size=cfg.batch_size)
            return {"agreement_mask": res["agreement"], "confidence_mask": res["confidence"],
                    "predictions": res["positions"]}

        run.heldout = heldout
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
    sums: dict[str, float] = {key: 0.0 for key in (*LOGGED, "predictions")}
    filled = 0  # micro-batches with an MTP region on this process
    for micro in range(cfg.grad_accum):
        idx = batch_indices(run.step, micro, acc.process_index, cfg, acc.num_processes, len(run.data))
        if micro == cfg.grad_accum - 1:
            sync: Any = contextlib.nullcontext()
        else:
            sync = fsdp.no_sync(run.student) if run.sharded else acc.no_sync(run.student)
        with sync, acc.autocast():
            out = batch_objective(run.setup, run.student, run.unwrapped, [run.data.seqs[i] for i in idx],
                                  [run.data.starts[i] for i in idx], k=k, offset=offset, spacing=run.spacing,
                                  num_regions=run.num_regions, soft_teacher=cfg.soft_teacher)
            if out is None:
                # No region in this batch (place_regions gives every row one, so only a future layout rule could
                # get here): a zero loss that touches every trainable weight keeps the processes in step.
                acc.backward(sum(p.sum() for p in run.params) * 0.0)
                continue
            acc.backward(out.loss / cfg.grad_accum)
        filled += 1
        for key, v in out.metrics().items():
            if key in sums:
                sums[key] += float(v)
    if float(acc.reduce(torch.tensor([float(filled)], device=acc.device), reduction="sum")) == 0:
        run.optimizer.zero_grad(set_to_none=True)  # no process had a region: skip the update, keep going
        run.step += 1
        return {"step": run.step, "event": "skipped", "why": f"no MTP region in the batch (k={k}, offset {offset})",
                "k": k, "offset": offset}
    sums = {key: v * cfg.grad_accum / max(filled, 1) for key, v in sums.items()}
    if run.sharded:  # DTensor gradients: torch's clip reduces the norm over the processes
        grad_norm = fsdp.as_float(torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip))
    else:
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
    trainable = {n for n, p in run.unwrapped.named_parameters() if p.requires_grad}

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
        acc.save_state(str(d))  # sharded: the RNG of every process only (the model was not handed to accelerate)
    finally:
        if handle is not None:
            handle.remove()
    if run.sharded:
        _save_sharded(run, d)
    if run.main and run.cfg.compact_checkpoints:
        _compact_optimizer_file(d)
    if run.main:
        state = {"step": run.step, "cpu_seconds": run.cpu_seconds, "sharded": run.sharded, "config": asdict(run.cfg)}
        (d / STATE_FILE).write_text(json.dumps(state, indent=1, default=str, allow_nan=False))
        for old in _checkpoints(run.output)[: -run.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return d


SHARDED_FILES = ("model.safetensors", "optimizer.bin", "scheduler.bin")


def _save_sharded(run: Run, d: Path) -> None:
    """An FSDP run's weights, AdamW state and schedule, gathered whole on process 0 and written as the
    files an unsharded full run's checkpoint holds (collective: every process calls it)."""
    from safetensors.torch import save_file

    weights = fsdp.full_model_state(run.student)
    optim = fsdp.full_optimizer_state(run.student, run.optimizer)
    if run.main:
        # clone: tied weights share storage, which safetensors refuses
        save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(d / SHARDED_FILES[0]))
        torch.save(optim, d / SHARDED_FILES[1])
        torch.save(run.scheduler.state_dict(), d / SHARDED_FILES[2])
    run.accelerator.wait_for_everyone()


def _load_sharded(run: Run, d: Path) -> None:
    from safetensors.torch import load_file

    missing = [f for f in SHARDED_FILES if not (d / f).is_file()]
    if missing:
        raise CheckpointError(f"{d}: incomplete checkpoint of a sharded (FSDP) run, it lacks {', '.join(missing)}.")
    fsdp.load_full_state(run.student, run.optimizer, load_file(str(d / SHARDED_FILES[0])),
                         torch.load(d / SHARDED_FILES[1], weights_only=False))
    run.scheduler.load_state_dict(torch.load(d / SHARDED_FILES[2], weights_only=False))


def resume_run(run: Run, resume_dir: Path | None) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into the run (nothing when None).

    Raises:
        CheckpointError: a checkpoint of a sharded (FSDP) run resumed without FSDP, or the other way round
            (their optimizer files differ).
    """
    if resume_dir is None:
        return
    state = json.loads((resume_dir / STATE_FILE).read_text())
    if bool(state.get("sharded", False)) != run.sharded:
        how = "with" if state.get("sharded") else "without"
        raise CheckpointError(f"{resume_dir} was written by a run {how} FSDP; resume it the same way "
                              f"({'accelerate launch --use_fsdp' if state.get('sharded') else 'no --use_fsdp'}), "
                              "or start a new --output.")
    # strict=False: an adapter run's checkpoint holds only the trainable weights (_trainable_only).
    run.accelerator.load_state(str(resume_dir), strict=run.setup.kind == "full")
    if run.sharded:
        _load_sharded(run, resume_dir)
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
    sd = _full_weights(run)
    if run.main:
        export_model(run.cfg, run.setup.lm, run.unwrapped, d, state_dict=sd)
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


def log_heldout(run: Run, when: str) -> None:
    """``--eval-examples``: the held-out figures logged as ``{"eval": when, ...}``. Process 0 scores
    them, or every process when the model is sharded (each forward pass gathers the layers)."""
    if run.heldout is None or not (run.main or run.sharded):
        return
    run.log({"eval": when, "step": run.step, **run.heldout()})


def finish(run: Run) -> None:
    """Final held-out evaluation, the export to ``output/final``, and the DDP digest (tests)."""
    log_heldout(run, "after")
    run.accelerator.wait_for_everyone()
    sd = _full_weights(run)
    if run.main:
        export_model(run.cfg, run.setup.lm, run.unwrapped, run.output / "final", state_dict=sd)
        print(f"saved {run.output / 'final'}", file=sys.stderr)
    if run.cfg.debug_dump_params:
        # sharded: the digest of the gathered weights (each process holds only its slice)
        digest = (state_digest(fsdp.full_model_state(run.student, everywhere=True)) if run.sharded
                  else params_digest(run.unwrapped))
        (run.output / f"params_rank{run.accelerator.process_index}.json").write_text(
            json.dumps({"step": run.step, "sha256": digest}, allow_nan=False))
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
    if run.step == 0:
        log_heldout(run, "before")
    started = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=run.step, disable=not run.main, desc=f"MTP {run.setup.kind}",
               dynamic_ncols=True)
    record: dict = {}
    run.student.train()
    stop = _out_of_time(run, started)  # a resumed run may have spent its CPU budget already
    saved = run.step
    while run.step < cfg.max_steps and stop is None:
        try:
            record = train_step(run)
        except Exception:
            # Keep what the run learned since its last checkpoint (one process only: under DDP the other
            # processes may be waiting in a collective operation that a save would deadlock on).
            if run.accelerator.num_processes == 1 and run.step > saved:
                run.optimizer.zero_grad(set_to_none=True)
                print(f"error at step {run.step + 1}; saved {save_checkpoint(run)} (continue with --resume auto)",
                      file=sys.stderr)
            raise
        if "event" in record or run.step % cfg.log_every == 0 or run.step == cfg.max_steps:
            run.log(record)
        bar.update(1)
        if "event" not in record:
            bar.set_postfix(loss=f"{record['loss']:.3f}", agree=f"{record['agreement_mask']:.2f}", k=record["k"],
                            seq_s=f"{record['seqs_per_s']:.2f}")
        stop = _out_of_time(run, started) if run.step < cfg.max_steps else None
        if run.step % cfg.save_every == 0 or run.step == cfg.max_steps or stop is not None:
            save_checkpoint(run)
            saved = run.step
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
