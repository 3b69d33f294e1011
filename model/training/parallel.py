"""How the processes of a run share the work: one object for what differs between data parallel training
(one process, or DDP through ``accelerate launch --multi_gpu``) and sharded training (FSDP2 through
``accelerate launch --use_fsdp``; :mod:`model.training.fsdp`).

The trainer asks a :class:`Parallel` to wrap the models, to accumulate gradients without syncing, to clip,
to gather whole weights for an export, to save and load what accelerate does not, and whether a process
scores the held-out set; it never branches on the launch kind itself.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from . import fsdp
from .config import TrainConfig
from .objective import Setup

#: The files a sharded run's checkpoint holds beside accelerate's RNG state (gathered whole on process 0).
SHARDED_FILES = ("model.safetensors", "optimizer.bin", "scheduler.bin")


class Parallel:
    """Data parallel (one process, or DDP): accelerate prepares the student, optimizer and schedule; every
    process holds the whole weights.

    Attributes:
        sharded: False here; True for :class:`Sharded` (written in checkpoints: a resume must match).
    """

    sharded = False

    def shard(self, setup: Setup) -> None:
        """Shard the models in place before the optimizer sees their parameters (nothing here)."""

    def prepare(self, accelerator: Any, student: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any, Any]:
        """The student, optimizer and schedule as the step uses them (accelerate's wrappers)."""
        return accelerator.prepare(student, optimizer, scheduler)

    def no_sync(self, accelerator: Any, student: Any) -> Any:
        """A context in which backward accumulates gradients without reducing them over the processes."""
        return accelerator.no_sync(student)

    def clip(self, accelerator: Any, params: list, max_norm: float) -> float:
        """Clip the gradients to ``max_norm`` (over all processes); returns the norm before clipping."""
        return float(accelerator.clip_grad_norm_(params, max_norm))

    def full_weights(self, accelerator: Any, student: Any) -> dict:
        """The whole model's state dict on process 0 (a collective)."""
        return accelerator.get_state_dict(student)

    def save(self, run: Any, directory: Path) -> None:
        """Write what accelerate's ``save_state`` left out (nothing here; a collective)."""

    def load(self, run: Any, directory: Path) -> None:
        """Read back what :meth:`save` wrote (nothing here; a collective)."""

    def scores_heldout(self, main: bool) -> bool:
        """Whether this process scores the held-out set (process 0: it holds the whole model)."""
        return main

    def digest_weights(self, unwrapped: Any, student: Any) -> dict[str, torch.Tensor]:
        """The whole weights of this process, named (for the digest every process writes in tests)."""
        return dict(unwrapped.named_parameters())


class Sharded(Parallel):
    """FSDP2 (:mod:`model.training.fsdp`): the trainer shards the student and the frozen teacher itself (every
    decoder layer, then the root) and keeps them away from ``accelerator.prepare``; checkpoints gather the
    whole weights and AdamW state on process 0 as ordinary files."""

    sharded = True

    def shard(self, setup: Setup) -> None:
        fsdp.shard(setup.student)
        fsdp.shard(setup.teacher)

    def prepare(self, accelerator: Any, student: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any, Any]:
        return student, optimizer, scheduler

    def no_sync(self, accelerator: Any, student: Any) -> Any:
        return fsdp.no_sync(student)

    def clip(self, accelerator: Any, params: list, max_norm: float) -> float:
        return fsdp.as_float(torch.nn.utils.clip_grad_norm_(params, max_norm))  # DTensors: torch reduces the norm

    def full_weights(self, accelerator: Any, student: Any) -> dict:
        return fsdp.full_model_state(student)

    def save(self, run: Any, directory: Path) -> None:
        from safetensors.torch import save_file

        weights = fsdp.full_model_state(run.student)
        optim = fsdp.full_optimizer_state(run.student, run.optimizer)
        if run.main:
            # clone: tied weights share storage, which safetensors refuses
            save_file({k: v.contiguous().clone() for k, v in weights.items()}, str(directory / SHARDED_FILES[0]))
            torch.save(optim, directory / SHARDED_FILES[1])
            torch.save(run.scheduler.state_dict(), directory / SHARDED_FILES[2])
        run.accelerator.wait_for_everyone()

    def load(self, run: Any, directory: Path) -> None:
        from safetensors.torch import load_file

        missing = [f for f in SHARDED_FILES if not (directory / f).is_file()]
        if missing:
            raise CheckpointError(f"{directory}: incomplete checkpoint of a sharded (FSDP) run, it lacks "
                                  f"{', '.join(missing)}.")
        fsdp.load_full_state(run.student, run.optimizer, load_file(str(directory / SHARDED_FILES[0])),
                             torch.load(directory / SHARDED_FILES[1], weights_only=False))
        run.scheduler.load_state_dict(torch.load(directory / SHARDED_FILES[2], weights_only=False))

    def scores_heldout(self, main: bool) -> bool:
        return True  # every forward pass gathers the layers: every process takes part

    def digest_weights(self, unwrapped: Any, student: Any) -> dict[str, torch.Tensor]:
        return fsdp.full_model_state(student, everywhere=True)  # each process holds only its slice


def parallel_for(cfg: TrainConfig) -> Parallel:
    """The launch's :class:`Parallel`: :class:`Sharded` under ``accelerate launch --use_fsdp`` (the request is
    taken here, before anything loads: transformers reads the same flag when loading), else :class:`Parallel`.

    Raises:
        ValueError: FSDP asked for a LoRA / aLoRA run, whose teacher is the student with its adapter switched
            off, which peft cannot do inside sharded modules (full fine-tunes shard on any device).
    """
    if not fsdp.take_request():
        return Parallel()
    if cfg.kind != "full":
        raise ValueError(f"FSDP trains full fine-tunes only: with --adapter {cfg.kind} the teacher is the student "
                         "with its adapter switched off, which peft cannot do inside sharded modules. Launch "
                         "with DDP (accelerate launch --multi_gpu ...) or use --adapter full (--lora-rank 0).")
    return Sharded()


def no_sync_unless_last(parallel: Parallel, accelerator: Any, student: Any, last: bool) -> Any:
    """:meth:`Parallel.no_sync` for the micro-batches of ``--grad-accum`` before the last one."""
    return contextlib.nullcontext() if last else parallel.no_sync(accelerator, student)
