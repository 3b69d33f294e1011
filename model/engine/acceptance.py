"""The accept phase's rules (paper 3.4, 4.5), which the strategies (:mod:`model.engine.strategies`) apply: a block
strategy keeps a leading run of its proposals (:func:`accept_block`), lossless verification keeps the drafts equal
to the model's own choice and then the model's next token (:func:`accept_verified`); and each under sampling
(:func:`accept_block_sampled`, :func:`accept_verified_sampled`; :mod:`model.engine.sampling`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .sampling import TokenSampler, draw_block, speculative_accept
from .text import continues_utf8, open_utf8_bytes, text_bytes

#: A block strategy's rule: the ``k_max`` confidences of a block -> ``(n, reason)``, how many to keep and why.
BlockRule = Callable[[Sequence[float]], "tuple[int, str]"]


@dataclass
class Acceptance:
    """What the accept phase decided for one pass.

    Attributes:
        kept: the tokens to emit, before trimming.
        reason: why the block ends (see :attr:`model.engine.records.PassRecord.block_end`).
        drafts_accepted: leading drafts equal to the model's own choice (verification; else 0).
        correction: the model's token in place of the first rejected draft, or None.
        next_drafts: the drafts the next pass feeds (verification; else empty).
        next_draft_probs: when sampling, ``[len(next_drafts), V]`` the distributions they were drawn from.
    """

    kept: list[int]
    reason: str
    drafts_accepted: int = 0
    correction: int | None = None
    next_drafts: list[int] = field(default_factory=list)
    next_draft_probs: torch.Tensor | None = None


def accept_drafts(drafts: Sequence[int], checks: Sequence[int]) -> int:
    """Leading drafts equal to the model's greedy choice at their place (lossless verification)."""
    n = 0
    while n < len(drafts) and drafts[n] == checks[n]:
        n += 1
    return n


def cut_broken_utf8(lm: Any, generated: Sequence[int], block: Sequence[int], n: int) -> int:
    """Shorten a kept block so that no proposal after the first breaks an open UTF-8 character.

    Args:
        lm: the model (its ``token_bytes``).
        generated: the tokens emitted before this block.
        block: the block's proposals; the first ``n`` are kept by the strategy.

    Returns:
        The new ``n`` (≥ 1: the first proposal is the model's own next token and always stays).
    """
    data = text_bytes(lm.token_bytes, list(generated[-4:]) + [block[0]])  # the last character starts in there
    for i in range(1, n):
        b = lm.token_bytes(block[i])
        if not continues_utf8(open_utf8_bytes(data), b):
            return i
        data += b
    return n


def accept_block(lm: Any, rule: BlockRule, generated: Sequence[int], tokens: Sequence[int],
                 conf: Sequence[float]) -> Acceptance:
    """A block strategy's acceptance: the leading run ``rule`` keeps of ``tokens`` (the proposal at the last real
    token, then one per mask), cut where a token would break an open UTF-8 character."""
    n, reason = rule(conf)
    cut = cut_broken_utf8(lm, generated, tokens, n)
    if cut < n:
        n, reason = cut, "utf-8"
    return Acceptance(list(tokens[:n]), reason)


def accept_block_sampled(lm: Any, rule: BlockRule, generated: Sequence[int], probs: torch.Tensor,
                         model_probs: torch.Tensor, sampler: TokenSampler
                         ) -> tuple[list[int], list[float], Acceptance]:
    """A block strategy under sampling: a token drawn at the last real token and at each mask, in order, and the
    leading run ``rule`` keeps judged by the drawn tokens' probabilities under the model's own distribution
    (``model_probs``, temperature 1: tau means what it means in greedy decoding, and near temperature 0 the rule is
    greedy ConfAdapt's; a tempered probability is near 1 for every draw there).

    Returns:
        ``(tokens, probabilities, acceptance)``: the drawn tokens and their probabilities under ``model_probs``.
    """
    tokens, _ = draw_block(sampler, probs)
    conf = [float(model_probs[j, t]) for j, t in enumerate(tokens)]
    return tokens, conf, accept_block(lm, rule, generated, tokens, conf)


def accept_verified(layout: Any, greedy: Sequence[int], drafts: Sequence[int]) -> Acceptance:
    """Lossless verification's acceptance: the leading drafts equal to the model's greedy choice at their place,
    then the model's own token after them (a correction where a draft was rejected); the next drafts are the
    proposals of the mask block that followed the accepted prefix, if one did.

    Args:
        layout: the pass's :class:`~model.engine.phases.PassLayout`; ``drafts``: the drafts it fed.
        greedy: greedy ids at the last pending token, each draft and each mask (``layout.logits_to_keep``).
    """
    d, m = layout.drafts, layout.masks_per_block
    own = greedy[: d + 1]  # the model's token after 0, 1, ..., d accepted drafts
    a = accept_drafts(drafts, own[:d])
    nxt: list[int] = []
    if a in layout.blocks:
        i = layout.blocks.index(a)
        nxt = list(greedy[d + 1 + i * m : d + 1 + (i + 1) * m])
    rejected = a < d
    return Acceptance(list(drafts[:a]) + [own[a]], "draft rejected" if rejected else "k_max", a,
                      own[a] if rejected else None, nxt)


def accept_verified_sampled(layout: Any, probs: torch.Tensor, model_probs: torch.Tensor, drafts: Sequence[int],
                            draft_probs: torch.Tensor | None, sampler: TokenSampler
                            ) -> tuple[list[int], list[float], Acceptance]:
    """Verification under sampling: drafts accepted by speculative sampling, then the tokens of the mask block after
    the accepted prefix drawn, if there is one: the next pass's drafts, with their distributions (the other blocks
    are not drawn; their most likely tokens are recorded).

    Args:
        probs: ``[layout.logits_to_keep, V]`` sampling distributions at the last pending token, each draft and mask.
        model_probs: the model's distributions there (the recorded confidences).
        draft_probs: ``[len(drafts), V]`` the distributions the drafts were drawn from (None without drafts).

    Returns:
        ``(tokens, probabilities, acceptance)``: per position the token this pass chose there (at a draft's place:
        the draft if accepted, the replacement at the first rejected one, the most likely token after it; at each
        mask: the drawn token, or the most likely one in a block not drawn) and its probability under
        ``model_probs``.
    """
    d, m = layout.drafts, layout.masks_per_block
    a, token, _ = speculative_accept(sampler, drafts, probs[: d + 1], draft_probs)
    tokens = list(drafts[:a]) + [token] + probs[a + 1:].argmax(-1).tolist()
    nxt, nxt_probs = [], None
    if a in layout.blocks:  # only the block after the accepted prefix is drawn: the next pass's drafts
        start = d + 1 + layout.blocks.index(a) * m
        nxt_probs = probs[start:start + m]
        nxt, _ = draw_block(sampler, nxt_probs)
        tokens[start:start + m] = nxt
    conf = [float(model_probs[j, t]) for j, t in enumerate(tokens)]
    rejected = a < d
    return tokens, conf, Acceptance(list(drafts[:a]) + [token], "draft rejected" if rejected else "k_max", a,
                                    token if rejected else None, nxt, nxt_probs)
