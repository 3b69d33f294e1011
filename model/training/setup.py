"""What trains and how: the student and its teacher, the trainable parts, the precision, the optimizer
(paper 3.3, 4.1-4.4).

* ``--adapter full`` (``--lora-rank 0``): every weight trains; the teacher is a frozen copy.
* ``--adapter lora`` (default, ``--lora-rank 16``): LoRA on all linear layers + the mask token's
  embedding row; the teacher is the same module with the adapter disabled.
* ``--adapter alora``: activated LoRA (peft ``alora_invocation_tokens=[mask]``): real tokens use
  the base weights, only mask positions the adapter; two-phase training.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from ..engine.adapter_format import load_mask_rows, read_meta
from ..engine.loaded_model import LoadedModel
from ..engine.loading import load_checkpoint, peft_quiet
from ..engine.precision import native_bf16
from ..errors import CheckpointError
from .config import DEFAULT_LORA_RANK, TrainConfig
from .objective import Setup


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
