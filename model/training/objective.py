"""The MTP self-distillation objective, student forced (paper 3.3; docs/DESIGN.md).

One training step on a blocked :class:`~model.training.layout.Layout`:

1. **student** forward (with gradient) -> logits at the ``P`` predicted positions;
   ``y'`` = their argmax (no gradient; the mask token is never proposed);
2. **teacher** forward (no gradient) on the same layout with every mask slot ``j`` replaced by
   ``y'`` of block position ``j - 1`` of its region, so the teacher's logits at block position ``j``
   are ``P_T(. | x_1..x_a, y'_1..y'_j)``;
3. labels: the teacher's argmax (hard teacher, default) or its full distribution (soft teacher);
   block positions after the row's EOS get the EOS as label (EOS rule);
4. loss: cross-entropy of the student's logits against the labels, averaged over predicted
   positions only (no loss on prefix positions).

:func:`alora_objective` is the same objective in the two-phase form of activated adapters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.nn.functional as F

from ..engine.loaded_model import LoadedModel
from .layout import Layout, SpanLayout, build_layout, build_span_layout, place_regions


@dataclass
class StepOutput:
    """Result of one objective evaluation.

    Attributes:
        loss: scalar tensor (with gradient when the student has trainable parameters).
        student_tokens: ``[P]`` student argmax ``y'`` per predicted position.
        labels: ``[P]`` hard labels (the teacher's argmax; EOS after the row's end).
        student_confidence: ``[P]`` student top-1 probability (float32, mask token excluded).
        block: ``[P]`` block index of each predicted position.
        k: the step's block size.
    """

    loss: torch.Tensor
    student_tokens: torch.Tensor
    labels: torch.Tensor
    student_confidence: torch.Tensor
    block: torch.Tensor
    k: int

    def metrics(self) -> dict[str, float]:
        """Logged scalars: ``loss``; ``confidence`` (mean student top-1 probability) and
        ``agreement`` (share of ``y'`` equal to the teacher's label) over all predicted positions,
        and both restricted to mask positions (block index ≥ 1: ``*_mask``); ``k``; ``predictions``."""
        agree = (self.student_tokens == self.labels).float()
        masks = self.block > 0
        nm = int(masks.sum())
        return {
            "loss": float(self.loss.detach()),
            "confidence": float(self.student_confidence.mean()) if agree.numel() else 0.0,
            "agreement": float(agree.mean()) if agree.numel() else 0.0,
            "confidence_mask": float(self.student_confidence[masks].mean()) if nm else 0.0,
            "agreement_mask": float(agree[masks].mean()) if nm else 0.0,
            "k": self.k,
            "predictions": int(agree.numel()),
        }


def _dtype_of(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype


def _up(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _suppress(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    out = _up(logits).clone()
    if mask_token_id < out.shape[-1]:
        out[..., mask_token_id] = float("-inf")
    return out


def gather_logits(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pred_batch: torch.Tensor,
    pred_index: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """One forward pass with an explicit 4D mask; logits at selected slots only.

    Args:
        model: a causal LM (or peft / DDP wrapper) accepting ``position_ids``, a 4D float
            ``attention_mask`` and a 1D tensor ``logits_to_keep``.
        input_ids, position_ids: ``[B, L]``.
        attention_mask: ``[B, 1, L, L_kv]`` float (0 / -inf); cast to the model's dtype.
        pred_batch, pred_index: ``[P]`` row and slot of each wanted position.
        kwargs: passed on (``past_key_values``, ``alora_offsets``, ...).

    Returns:
        ``[P, V]`` logits in the model's dtype (only the needed slots go through the LM head).
    """
    keep = torch.unique(pred_index)
    out = model(
        input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask.to(_dtype_of(model)),
        logits_to_keep=keep, use_cache=kwargs.pop("use_cache", False), **kwargs,
    )
    col = torch.searchsorted(keep, pred_index)
    return out.logits[pred_batch, col]


def student_logits(model: Any, layout: Layout) -> torch.Tensor:
    """Student logits ``[P, V]`` at the layout's predicted positions (one blocked forward pass)."""
    return gather_logits(model, layout.input_ids, layout.position_ids, layout.attention_mask,
                         layout.pred_batch, layout.pred_index)


def teacher_input_ids(layout: Layout, student_tokens: torch.Tensor) -> torch.Tensor:
    """The teacher's ``[B, L]`` input: each mask slot (block index ``j ≥ 1``) holds the student's
    argmax at block index ``j - 1`` of the same region (predictions are ordered region by region)."""
    ids = layout.input_ids.clone()
    sel = torch.nonzero(layout.pred_block > 0).flatten()
    ids[layout.pred_batch[sel], layout.pred_index[sel]] = student_tokens[sel - 1].to(ids.dtype)
    return ids


def _labels_and_loss(
    s_logits: torch.Tensor, t_logits: torch.Tensor, after_eos: torch.Tensor, use: torch.Tensor, *,
    mask_token_id: int, eos_token_id: int, soft_teacher: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    t = _suppress(t_logits, mask_token_id)
    labels = t.argmax(-1)
    labels = torch.where(after_eos, torch.full_like(labels, eos_token_id), labels)
    s = _up(s_logits)
    if not bool(use.any()):
        return labels, s.sum() * 0.0
    if soft_teacher:
        target = torch.softmax(t, dim=-1)
        target = torch.where(after_eos[:, None], F.one_hot(labels, t.shape[-1]).to(target.dtype), target)
        loss = F.cross_entropy(s[use], target[use])
    else:
        loss = F.cross_entropy(s[use], labels[use])
    return labels, loss


def mtp_objective(
    student: Any,
    layout: Layout,
    *,
    mask_token_id: int,
    eos_token_id: int,
    teacher: Any | None = None,
    teacher_context: Callable[[], ContextManager] | None = None,
    soft_teacher: bool = False,
) -> StepOutput:
    """Student-forced self-distillation loss on one blocked layout (paper 3.3).

    Args:
        student: the trained model (any wrapper); called with gradient.
        layout: from :func:`model.training.layout.build_layout`, on the model's device.
        mask_token_id: never proposed by the student nor used as a label.
        eos_token_id: label for block positions after the row's EOS.
        teacher: the frozen teacher; default: ``student`` itself.
        teacher_context: factory of a context in which ``teacher`` acts as the teacher (e.g.
            peft's ``disable_adapter`` — one copy of the weights for both).
        soft_teacher: cross-entropy against the teacher's full distribution instead of its argmax.

    Returns:
        :class:`StepOutput` (``loss`` over all ``P`` predicted positions).
    """
    s_logits = student_logits(student, layout)  # [P, V]
    with torch.no_grad():
        s_prob = torch.softmax(_suppress(s_logits.detach(), mask_token_id), dim=-1)
        conf, y = s_prob.max(dim=-1)
        t_ids = teacher_input_ids(layout, y)
        ctx = teacher_context() if teacher_context is not None else contextlib.nullcontext()
        with ctx:
            t_logits = gather_logits(teacher if teacher is not None else student, t_ids, layout.position_ids,
                                     layout.attention_mask, layout.pred_batch, layout.pred_index)
    use = torch.ones_like(layout.pred_block, dtype=torch.bool)
    labels, loss = _labels_and_loss(s_logits, t_logits, layout.pred_after_eos, use, mask_token_id=mask_token_id,
                                    eos_token_id=eos_token_id, soft_teacher=soft_teacher)
    return StepOutput(loss=loss, student_tokens=y, labels=labels, student_confidence=conf, block=layout.pred_block,
                      k=layout.k)


# ----------------------------------------------------------------------- activated adapters
def phase1_prefix(model: Any, span: SpanLayout) -> tuple[Any, torch.Tensor]:
    """Phase 1: the plain causal forward of the ground truth, without gradient (adapter-off base).

    Call inside the context that disables the adapter. Returns ``(cache, anchor_logits)``: the
    transformers KV cache of ``span.gt_ids`` (``N`` entries per row) and ``[P, V]`` logits at each
    prediction's anchor (the base model's next-token logits, block index 0).
    """
    with torch.no_grad():
        keep = torch.unique(span.pred_anchor)
        out = model(input_ids=span.gt_ids, use_cache=True, logits_to_keep=keep)
        col = torch.searchsorted(keep, span.pred_anchor)
        return out.past_key_values, out.logits[span.pred_batch, col]


def phase2_logits(model: Any, span: SpanLayout, cache: Any, span_ids: torch.Tensor | None = None,
                  **kwargs: Any) -> torch.Tensor:
    """Phase 2: the mask spans (or ``span_ids``) over the cached prefix; logits ``[P, V]``.

    Rows of predictions with block index 0 (no span slot) read slot 0 and must be ignored by the
    caller. The cache is cropped back to the prefix afterwards. ``kwargs`` go to the model
    (``alora_offsets``).
    """
    slot = span.pred_span_slot.clamp(min=0)
    S = span.span_len
    try:
        return gather_logits(model, span.span_ids if span_ids is None else span_ids, span.span_position_ids,
                             span.attention_mask, span.pred_batch, slot, past_key_values=cache, use_cache=True,
                             **kwargs)
    finally:
        cache.crop(-S)


def alora_objective(
    model: Any,
    span: SpanLayout,
    *,
    mask_token_id: int,
    eos_token_id: int,
    base_context: Callable[[], ContextManager],
    soft_teacher: bool = False,
    unwrapped: Any | None = None,
) -> StepOutput:
    """The MTP objective for an activated adapter, in two phases.

    Phase 1 runs the base (``base_context``: adapter off) over the ground truth once, without
    gradient, and keeps its KV cache; its logits at each anchor are both the student's and the
    teacher's block position 0 (real tokens never pass through the adapter). Phase 2 feeds all
    mask spans over that cache with the adapter active on every span slot
    (``alora_offsets = [S] * B``) and gradient; the teacher pass scores the student's block
    ``y'`` on the same spans with the adapter off. The loss covers block positions ``j ≥ 1``.

    Args:
        model: the peft aLoRA model (possibly DDP-wrapped: then pass the plain module as ``unwrapped``).
        span: from :func:`model.training.layout.build_span_layout`, on the model's device.
        base_context: factory of the adapter-off context (``unwrapped.disable_adapter``).

    Returns:
        :class:`StepOutput`.
    """
    unwrapped = unwrapped if unwrapped is not None else model
    B = span.gt_ids.shape[0]
    with base_context():
        cache, anchor_logits = phase1_prefix(unwrapped, span)
    masks = span.pred_block > 0
    s_mask = phase2_logits(model, span, cache, alora_offsets=[span.span_len] * B)
    s_logits = torch.where(masks[:, None], s_mask, anchor_logits.to(s_mask.dtype))
    with torch.no_grad():
        s_prob = torch.softmax(_suppress(s_logits.detach(), mask_token_id), dim=-1)
        conf, y = s_prob.max(dim=-1)
        t_ids = span.span_ids.clone()
        sel = torch.nonzero(masks).flatten()
        t_ids[span.pred_batch[sel], span.pred_span_slot[sel]] = y[sel - 1]
        with base_context():
            t_mask = phase2_logits(unwrapped, span, cache, span_ids=t_ids)
        t_logits = torch.where(masks[:, None], t_mask, anchor_logits.to(t_mask.dtype))
    labels, loss = _labels_and_loss(s_logits, t_logits, span.pred_after_eos, masks, mask_token_id=mask_token_id,
                                    eos_token_id=eos_token_id, soft_teacher=soft_teacher)
    return StepOutput(loss=loss, student_tokens=y, labels=labels, student_confidence=conf, block=span.pred_block,
                      k=span.k)


# ----------------------------------------------------------------------- one batch, as training lays it out
@dataclass
class Setup:
    """The student and how to get its teacher.

    Attributes:
        lm: the loaded model (``lm.model`` is the student: a peft model for lora / alora).
        student: the trainable module.
        teacher: a frozen copy for full fine-tuning; None for adapters (the teacher is the student
            with its adapter disabled, peft's ``disable_adapter``) and when the model is its own teacher.
        kind: ``full``, ``lora`` or ``alora``.
    """

    lm: LoadedModel
    student: Any
    teacher: Any | None
    kind: str


def pad_id(lm: LoadedModel) -> int:
    """The padding id of layouts (the tokenizer's pad token, else the model's EOS, else 0)."""
    tok = lm.tokenizer
    if tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    return int(lm.stop_token_ids[0]) if lm.stop_token_ids else 0


def batch_objective(setup: Setup, model: Any, unwrapped: Any, seqs: Sequence[Sequence[int]], starts: Sequence[int], *,
                    k: int, offset: int, spacing: int, num_regions: int, soft_teacher: bool = False
                    ) -> StepOutput | None:
    """Lay out one batch (regions on the grid, :mod:`model.training.layout`) and evaluate the objective on
    it (:func:`alora_objective` for activated adapters, else :func:`mtp_objective`): shared by the
    training step and the held-out scoring.

    Args:
        model: the student as called (possibly DDP-wrapped); ``unwrapped``: the plain module.
        seqs: ground-truth rows (prompt + response token ids); ``starts``: each row's first response index.
        k: block size; ``offset``, ``spacing``, ``num_regions``: the region grid.

    Returns:
        The :class:`StepOutput`, or None when the batch holds no region (every row too short for a
        block at this grid).
    """
    lm = setup.lm
    pad = pad_id(lm)
    # Rows end with the model's first stop token (training.data.encode); a model without one has no EOS
    # rule (no region ever reaches an EOS, so the label used after it never appears).
    eos = int(lm.stop_token_ids[0]) if lm.stop_token_ids else pad
    regions = place_regions(seqs, starts, k=k, offset=offset, spacing=spacing, num_regions=num_regions,
                            eos_token_id=list(lm.stop_token_ids))
    if not regions:
        return None
    layout = build_layout(seqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=pad)
    dev = next(unwrapped.parameters()).device
    ctx = unwrapped.disable_adapter if setup.kind != "full" else None
    if setup.kind == "alora":
        span = build_span_layout(layout, mask_token_id=lm.mask_token_id, pad_token_id=pad).to(dev)
        return alora_objective(model, span, mask_token_id=lm.mask_token_id, eos_token_id=eos, base_context=ctx,
                               soft_teacher=soft_teacher, unwrapped=unwrapped)
    return mtp_objective(model, layout.to(dev), mask_token_id=lm.mask_token_id, eos_token_id=eos,
                         teacher=setup.teacher, teacher_context=ctx, soft_teacher=soft_teacher)
