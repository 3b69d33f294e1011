"""Scoring an answer under the teacher: the base model with any MTP adapter off (paper 4.5, "quality
under the teacher").

One forward pass over prompt + answer; log-softmax in float32 over the vocabulary without the mask
token (as the decoder's confidences). Used by the evaluation, the lm-eval model and the app.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from .loaded_model import LoadedModel


def _prefix_cache(cache: Any, n: int) -> Any:
    """A new KV cache holding the first ``n`` entries of ``cache`` (which is left as it was)."""
    from .kv_cache import KVCache

    if isinstance(cache, KVCache):
        return cache.copy_prefix(n)
    new = copy.deepcopy(cache)  # a transformers Cache (the library path): crop takes what to drop
    if new.get_seq_length() > n:
        new.crop(n - new.get_seq_length())
    return new


@torch.inference_mode()
def teacher_logprob(lm: LoadedModel, context_ids: Sequence[int], continuation_ids: Sequence[int], *,
                    context_cache: tuple[Any, Sequence[int]] | None = None) -> tuple[float, bool]:
    """Log-probability (nats) of ``continuation_ids`` after ``context_ids`` under the teacher, and
    whether every continuation token is the teacher's greedy choice.

    The teacher is the base model with any MTP adapter off (:meth:`LoadedModel.base_model`).
    One forward pass over ``[1, C + A]`` tokens into a new KV cache, on the model's own engine
    (:meth:`LoadedModel.forward`: our kernels where they run; a 95-token prompt + 120-token
    answer took 0.85 s there and 5.7 s through transformers' forward, bf16, one thread, an AVX2
    CPU); log-softmax in float32 over the vocabulary without the mask token (as the decoder's
    confidences), so for standard decoding the log-probability of each token is the log of its
    confidence.

    Args:
        context_cache: ``(cache, cached_ids)``: a KV cache of the *teacher* over ``cached_ids`` (e.g. the
            standard side's :attr:`~model.engine.decoding.Decoder.cache` where
            :attr:`LoadedModel.real_tokens_run_base`). Its entries for the longest common prefix of ``cached_ids`` and
            the context, up to ``C - 1`` tokens, are copied, so the pass feeds only the rest (an answer's
            scoring pass costs ``A + 1`` tokens, not a prefill of the whole conversation). The given cache is
            left as it was. The same values as without it, within the float rounding of a cached pass.

    Returns:
        ``(sum_logprob, is_greedy)``; ``(0.0, True)`` for an empty continuation.
    """
    n = len(continuation_ids)
    if not n:
        return 0.0, True
    context = [int(t) for t in context_ids]
    reuse = 0
    if context_cache is not None:
        cache, cached_ids = context_cache
        limit = min(len(context) - 1, len(cached_ids), cache.get_seq_length())
        while reuse < limit and int(cached_ids[reuse]) == context[reuse]:
            reuse += 1
    ids = torch.tensor([context[reuse:] + list(continuation_ids)], dtype=torch.long, device=lm.device)
    with lm.base_model():
        cache = _prefix_cache(context_cache[0], reuse) if reuse else lm.new_cache()
        logits = lm.forward(ids, cache, num_masks=0, logits_to_keep=n + 1)[0, :-1].float()
    logits[:, lm.mask_token_id] = float("-inf")  # as in decoding: the mask token is never a candidate
    logp = torch.log_softmax(logits, dim=-1)
    target = ids[0, -n:]
    total = logp.gather(1, target[:, None]).sum().item()
    return float(total), bool((logp.argmax(dim=-1) == target).all())


def teacher_nll(lm: LoadedModel, prompt_ids: Sequence[int], answer_ids: Sequence[int], *,
                context_cache: tuple[Any, Sequence[int]] | None = None) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of ``answer_ids`` after ``prompt_ids`` under the teacher
    (:func:`teacher_logprob`, ``context_cache`` as there). Returns ``(sum_nll, A)``, ``(0.0, 0)`` for an
    empty answer."""
    return -teacher_logprob(lm, prompt_ids, answer_ids, context_cache=context_cache)[0] + 0.0, len(answer_ids)
