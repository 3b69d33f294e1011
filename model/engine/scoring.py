"""Scoring an answer under the teacher: the base model with any MTP adapter off (paper 4.5, "quality
under the teacher").

One forward pass over prompt + answer; log-softmax in float32 over the vocabulary without the mask
token (as the decoder's confidences). Used by the evaluation, the lm-eval model and the app.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .loaded_model import LoadedModel


@torch.inference_mode()
def teacher_logprob(lm: LoadedModel, context_ids: Sequence[int], continuation_ids: Sequence[int]
                    ) -> tuple[float, bool]:
    """Log-probability (nats) of ``continuation_ids`` after ``context_ids`` under the teacher, and
    whether every continuation token is the teacher's greedy choice.

    The teacher is the base model with any MTP adapter off (:meth:`LoadedModel.base_model`).
    One forward pass over ``[1, C + A]`` tokens; log-softmax in float32 over the vocabulary
    without the mask token (as the decoder's confidences), so for standard decoding the
    log-probability of each token is the log of its confidence.

    Returns:
        ``(sum_logprob, is_greedy)``; ``(0.0, True)`` for an empty continuation.
    """
    n = len(continuation_ids)
    if not n:
        return 0.0, True
    ids = torch.tensor([list(context_ids) + list(continuation_ids)], dtype=torch.long, device=lm.device)
    with lm.base_model() as model:
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=n + 1).logits[0, :-1].float()
    logits[:, lm.mask_token_id] = float("-inf")  # as in decoding: the mask token is never a candidate
    logp = torch.log_softmax(logits, dim=-1)
    target = ids[0, -n:]
    total = logp.gather(1, target[:, None]).sum().item()
    return float(total), bool((logp.argmax(dim=-1) == target).all())


def teacher_nll(lm: LoadedModel, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of ``answer_ids`` after ``prompt_ids`` under the teacher
    (:func:`teacher_logprob`). Returns ``(sum_nll, A)``, ``(0.0, 0)`` for an empty answer."""
    return -teacher_logprob(lm, prompt_ids, answer_ids)[0] + 0.0, len(answer_ids)
