"""Saving and resuming a run (``checkpoint-STEP/``) and exporting what it trained (``exports/step-N/``,
``final/``) in the format :func:`model.engine.loading.load_checkpoint` reads.

A checkpoint is accelerate's state (weights, optimizer, scheduler, RNG of every process) plus
``trainer_state.json`` (step, training CPU seconds, config); an adapter run saves its trainable weights only
(the frozen base is reloaded from its source). A resume truncates the log to the checkpoint's step, so each
step appears once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..engine.adapter_format import MTPMeta, read_meta, save_mtp_checkpoint
from ..engine.loaded_model import LoadedModel
from ..errors import CheckpointError
from .config import TrainConfig

LOG_FILE = "train_log.jsonl"
STATE_FILE = "trainer_state.json"


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


def list_checkpoints(output: Path) -> list[Path]:
    """The resumable checkpoints in ``output``, oldest first."""
    found = [p for p in output.glob("checkpoint-*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def resolve_resume(resume: str, output: Path) -> Path | None:
    """``--resume`` value -> a checkpoint directory (``auto``/an output dir: its latest checkpoint).

    Raises:
        ValueError: a path that holds no resumable checkpoint.
    """
    if resume == "auto":
        cps = list_checkpoints(output)
        return cps[-1] if cps else None
    p = Path(resume)
    if (p / STATE_FILE).is_file():
        return p
    cps = list_checkpoints(p) if p.is_dir() else []
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


def full_weights(run: Any) -> dict | None:
    """A full fine-tune's whole weights for an export (process 0; a collective under DDP and FSDP);
    None for adapters (the export reads the adapter from the module)."""
    if run.setup.kind != "full":
        return None
    return run.parallel.full_weights(run.accelerator, run.student)


def _trainable_only(run: Any) -> Any:
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


def save_checkpoint(run: Any) -> Path:
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
    run.parallel.save(run, d)
    if run.main and run.cfg.compact_checkpoints:
        _compact_optimizer_file(d)
    if run.main:
        state = {"step": run.step, "cpu_seconds": run.cpu_seconds, "sharded": run.parallel.sharded, "config": asdict(run.cfg)}
        (d / STATE_FILE).write_text(json.dumps(state, indent=1, default=str, allow_nan=False))
        for old in list_checkpoints(run.output)[: -run.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return d


def resume_run(run: Any, resume_dir: Path | None) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into the run (nothing when None).

    Raises:
        CheckpointError: a checkpoint of a sharded (FSDP) run resumed without FSDP, or the other way round
            (their optimizer files differ).
    """
    if resume_dir is None:
        return
    state = json.loads((resume_dir / STATE_FILE).read_text())
    if bool(state.get("sharded", False)) != run.parallel.sharded:
        how = "with" if state.get("sharded") else "without"
        raise CheckpointError(f"{resume_dir} was written by a run {how} FSDP; resume it the same way "
                              f"({'accelerate launch --use_fsdp' if state.get('sharded') else 'no --use_fsdp'}), "
                              "or start a new --output.")
    # strict=False: an adapter run's checkpoint holds only the trainable weights (_trainable_only).
    run.accelerator.load_state(str(resume_dir), strict=run.setup.kind == "full")
    run.parallel.load(run, resume_dir)
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


def export_snapshot(run: Any) -> Path | None:
    """``--export-every``: the model as the final export would be now, in ``exports/step-STEP``
    (a loadable adapter or model directory: a curve of held-out figures against sequences seen)."""
    d = run.output / "exports" / f"step-{run.step}"
    sd = full_weights(run)
    if run.main:
        export_model(run.cfg, run.setup.lm, run.unwrapped, d, state_dict=sd)
        (d / "trained.json").write_text(json.dumps({"step": run.step, "seen": run.step * run.per_step,
                                                    "cpu_seconds": round(run.cpu_seconds, 2)}, allow_nan=False))
    run.accelerator.wait_for_everyone()
    return d if run.main else None
