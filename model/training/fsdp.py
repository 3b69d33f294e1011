"""Fully sharded data parallel training of full fine-tunes: torch's FSDP2 (``fully_shard``).

``accelerate launch --use_fsdp`` starts the processes and sets ``ACCELERATE_USE_FSDP``; the trainer
then shards the student and the frozen teacher itself with :func:`shard` (every decoder layer, then
the whole model: parameters, gradients and AdamW moments live as 1/world-size slices per process,
gathered layer by layer for each forward and backward) instead of handing the model to accelerate.
Two reasons: accelerate's FSDP runs only on GPUs (on a CPU it falls back to DDP, and its FSDP1
plugin fails to start there), while ``fully_shard`` runs on any device torch.distributed has a
backend for (gloo on CPUs, NCCL on GPUs) — so the two-process CPU test covers the very code a GPU
run uses; and transformers reads ``ACCELERATE_USE_FSDP`` while loading weights (ranks other than 0
then load nothing), which :func:`take_request` turns off before anything loads.

LoRA and activated LoRA are not sharded: their teacher is the student with its adapter switched off
(peft's ``disable_adapter``), which peft does not support inside sharded modules; the trainer refuses
that combination at start.

Checkpoints of a sharded run hold the *full* weights and optimizer state (gathered on process 0;
:func:`full_model_state`, :func:`full_optimizer_state`), so they are ordinary files and resume at any
number of processes of the same launch kind.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

ENV_FLAG = "ACCELERATE_USE_FSDP"


def requested(environ: Any = None) -> bool:
    """Whether this process was launched for FSDP (``accelerate launch --use_fsdp`` sets the flag)."""
    env = os.environ if environ is None else environ
    return str(env.get(ENV_FLAG, "")).lower() in ("1", "true", "yes")


def take_request() -> bool:
    """:func:`requested`, then clear the flag for the rest of the process.

    After this call neither accelerate (which would otherwise try its own FSDP plugin, or DDP on a CPU)
    nor transformers (which would load no weights on ranks other than 0) acts on it: the trainer shards
    the model itself with :func:`shard`. Idempotent in effect: a second call returns False.
    """
    wanted = requested()
    os.environ.pop(ENV_FLAG, None)
    return wanted


def _block_classes(model: Any) -> set[str]:
    names = getattr(model, "_no_split_modules", None) or []
    return {str(n) for n in names}


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """Shard ``model`` in place with ``torch.distributed.fsdp.fully_shard``: each decoder layer (the
    classes the model lists in ``_no_split_modules``, as accelerate's auto-wrap policy does) is one
    unit, the rest (embeddings, final norm, output layer; tied weights stay one parameter) the root.

    Needs an initialised process group (accelerate's). Returns the same module, whose parameters are
    now DTensors holding this process's slice.

    Raises:
        RuntimeError: no process group.
    """
    from torch.distributed.fsdp import fully_shard

    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise RuntimeError("FSDP needs a process group: launch with accelerate launch --use_fsdp --num_processes N.")
    blocks = _block_classes(model)
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)
    return model


def as_float(x: Any) -> float:
    """A scalar tensor, DTensor (e.g. the gradient norm of sharded parameters) or number as a float."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)


def full_model_state(model: torch.nn.Module, *, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a sharded model, on the CPU. A collective: every process
    must call it. Process 0 gets the tensors; the others an empty dict unless ``everywhere``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not everywhere))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The full AdamW state of a sharded model (keyed by parameter name), on process 0 (others: empty).
    A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optimizer_state: dict) -> None:
    """Load full state dicts (as :func:`full_model_state` / :func:`full_optimizer_state` wrote them;
    every process passes the whole dicts) into a sharded model and its optimizer, each process keeping
    its slice. A collective."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=opts)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=opts)


@contextlib.contextmanager
def no_sync(model: Any) -> Iterator[None]:
    """Accumulate gradients locally (no reduce-scatter) inside the block: the micro-batches of
    ``--grad-accum`` before the last one."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
