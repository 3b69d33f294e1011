"""The training run: online self-distillation of an MTP model (paper 3.3, 4.1-4.4).

Each optimizer step draws one block size ``k`` in ``[k_min, k_max]`` and one region-grid offset, lays
out ``--batch-size`` sequences per process with ``M`` MTP regions each
(:mod:`model.training.layout`), and minimises the student-forced self-distillation loss
(:mod:`model.training.objective`). The run is built from four rooms: what trains and how
(:mod:`model.training.setup`: full, LoRA or activated LoRA, precision, optimizer), the data
(:mod:`model.training.data`), how processes share the work (:mod:`model.training.parallel`: DDP or FSDP
behind one object) and checkpoints and exports (:mod:`model.training.checkpoints`); this module is the loop.

Phases: :func:`prepare_run` (data, model, optimizer, resume), :func:`train_step` until ``--max-steps``
or a time budget, :func:`save_checkpoint` / :func:`export_snapshot` along the way, :func:`finish`.
Mixed precision ``auto`` is bf16 autocast wherever the device computes bf16 natively. DDP runs under
``accelerate launch`` (tested with 2 CPU processes). ``accelerate launch --use_fsdp`` shards a full
fine-tune with torch's FSDP2 on any device (:mod:`model.training.fsdp`; tested with 2 CPU processes);
it is refused at start for LoRA / aLoRA, whose teacher is the student with its adapter disabled
(peft cannot switch an adapter off inside sharded modules): :func:`model.training.parallel.parallel_for`.

Outputs in ``--output``: ``train_log.jsonl`` (one JSON object per step, plus ``event`` lines: the
data, skipped batches, evaluations), ``checkpoint-STEP/`` (resumable: trainable weights, optimizer,
scheduler, RNG, step, training CPU seconds), ``exports/step-N/`` with ``--export-every N``, and the
final export: a full model directory (tokenizer with the mask token) or an adapter directory
(``mtp_adapter.json`` + ``mask_rows.safetensors`` + peft files) that
:func:`model.engine.loading.load_checkpoint` loads.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..engine.loaded_model import LoadedModel
from ..engine.loading import resolve_device
from ..errors import NonFiniteLossError
from .checkpoints import (LOG_FILE, export_model, export_snapshot, full_weights, list_checkpoints, resolve_resume,
                          resume_run, save_checkpoint, state_digest)
from .config import TrainConfig
from .data import Example, TrainData, batch_indices, encode, load_examples, prepare_data
from .heldout import score_agreement
from .layout import default_num_regions, sample_block
from .objective import Setup, batch_objective
from .parallel import Parallel, no_sync_unless_last, parallel_for
from .setup import build_optimizer, load_for_training, resolve_mixed_precision


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
    parallel: Parallel = field(default_factory=Parallel)  # DDP / one process, or FSDP (model.training.parallel)
    after_step: list[Callable[["Run"], None]] = field(default_factory=list)  # called after every step
    at_finish: list[Callable[["Run"], None]] = field(default_factory=list)  # called after the final export

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
    parallel = parallel_for(cfg)  # before anything loads: transformers reads the FSDP flag when loading
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
    parallel.shard(setup)
    params, optimizer, scheduler = build_optimizer(cfg, setup.student)
    student, optimizer, scheduler = parallel.prepare(accelerator, setup.student, optimizer, scheduler)
    run = Run(cfg=cfg, accelerator=accelerator, setup=setup, student=student, unwrapped=accelerator.unwrap_model(student),
              optimizer=optimizer, scheduler=scheduler, params=params, data=data,
              num_regions=cfg.num_regions or default_num_regions(cfg.seq_len, cfg.k_max),
              spacing=cfg.spacing or 2 * cfg.k_max, output=output, parallel=parallel,
              after_step=testing_hooks(cfg), at_finish=[dump_digest] if cfg.debug_dump_params else [])
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
        sync = no_sync_unless_last(run.parallel, acc, run.student, micro == cfg.grad_accum - 1)
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
    grad_norm = run.parallel.clip(acc, run.params, cfg.grad_clip)
    bad = torch.tensor([float(not math.isfinite(sums["loss"]) or not math.isfinite(float(grad_norm)))],
                       device=acc.device)
    if float(acc.reduce(bad, reduction="max")) > 0:  # every process stops, before any update
        run.optimizer.zero_grad(set_to_none=True)
        last = list_checkpoints(run.output)
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
    if run.heldout is None or not run.parallel.scores_heldout(run.main):
        return
    run.log({"eval": when, "step": run.step, **run.heldout()})


def finish(run: Run) -> None:
    """Final held-out evaluation, the export to ``output/final``, and the DDP digest (tests)."""
    log_heldout(run, "after")
    run.accelerator.wait_for_everyone()
    sd = full_weights(run)
    if run.main:
        export_model(run.cfg, run.setup.lm, run.unwrapped, run.output / "final", state_dict=sd)
        print(f"saved {run.output / 'final'}", file=sys.stderr)
    for hook in run.at_finish:
        hook(run)
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()


# ------------------------------------------------------------------------------ hooks for the tests' hidden flags
def testing_hooks(cfg: TrainConfig) -> list[Callable[[Run], None]]:
    """After-step hooks of the hidden test flags: ``--debug-crash-after-step N`` kills the process after step N
    (as a killed job would die: the tests of ``--resume``)."""
    if cfg.debug_crash_after_step is None:
        return []

    def crash(run: Run) -> None:
        if run.step == cfg.debug_crash_after_step:
            run.accelerator.wait_for_everyone()
            os.kill(os.getpid(), signal.SIGKILL)

    return [crash]


def dump_digest(run: Run) -> None:
    """``--debug-dump-params``: every process writes the digest of its whole weights (DDP / FSDP tests: equal
    digests = identical weights on every process)."""
    digest = state_digest(run.parallel.digest_weights(run.unwrapped, run.student))
    (run.output / f"params_rank{run.accelerator.process_index}.json").write_text(
        json.dumps({"step": run.step, "sha256": digest}, allow_nan=False))


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
        for hook in run.after_step:
            hook(run)
    bar.close()
    if stop is not None and run.main:
        print(f"stopping after {stop} at step {run.step}", file=sys.stderr)
    finish(run)
    return record
