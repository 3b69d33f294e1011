"""The phases of one forward pass (paper 3.4, 4.5; :meth:`model.engine.decoding.Decoder.run_pass` runs them in order):
the layout a pass feeds (:func:`lay_out`), **propose** (:func:`propose`), **accept** (:func:`accept`, greedy; or
:func:`accept_sampled`), **trim** (:func:`trim`, :func:`cut_at_stop_string`) and **commit** (:func:`commit`), and the
checks before them (:func:`check_context_budget`, :func:`check_finite`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import ContextBudgetError, NonFiniteLogitsError
from .loaded_model import LoadedModel
from .sampling import TokenSampler, draw_block, speculative_accept
from .strategies import Strategy
from .text import continues_utf8, open_utf8_bytes, text_bytes


def check_context_budget(lm: LoadedModel, prompt_len: int, max_new_tokens: int, strategy: Strategy) -> None:
    """Refuse a generation whose positions could run past the model's ``max_position_embeddings``.

    The budget is ``prompt_len + max_new_tokens + strategy.lookahead`` positions (the look-ahead is
    the drafts and mask tokens a pass feeds after the last emitted token).

    Raises:
        ContextBudgetError: over the limit, naming the limit and each part.
    """
    limit = lm.max_positions
    need = prompt_len + max_new_tokens + strategy.lookahead
    if limit is not None and need > limit:
        raise ContextBudgetError(
            f"The prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + {strategy.lookahead} "
            f"look-ahead positions of {strategy.label} = {need} positions, more than this model's "
            f"{limit} (max_position_embeddings). Shorten the prompt or lower max_new_tokens.")


def check_finite(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (``[T, V]``) when every value is finite.

    Raises:
        NonFiniteLogitsError: a NaN or infinite logit (no token can be chosen from it).
    """
    if not bool(torch.isfinite(logits).all()):
        bad = (~torch.isfinite(logits)).any(-1).nonzero().flatten().tolist()
        raise NonFiniteLogitsError(
            f"The forward pass produced NaN or infinite logits at {len(bad)} of {logits.shape[0]} positions; "
            "no token can be chosen. The weights or the dtype cannot represent this computation "
            "(e.g. float16 on a CPU); load the model in float32 or bfloat16.")
    return logits


def propose(logits: torch.Tensor, mask_token_id: int) -> tuple[list[int], list[float]]:
    """Greedy proposals and their confidences for each position of one pass.

    Args:
        logits: ``[T, V]`` logits (any float dtype) at the positions that propose.
        mask_token_id: never proposed.

    Returns:
        ``(tokens, confidences)``: ``T`` greedy ids and their top-1 probabilities (float32 softmax
        over the vocabulary without the mask token).

    Raises:
        NonFiniteLogitsError: a NaN or infinite logit (the softmax would be meaningless).
    """
    logits = logits.float()
    logits[:, mask_token_id] = float("-inf")
    conf, tokens = torch.softmax(logits, dim=-1).max(dim=-1)
    if not bool(torch.isfinite(conf).all()):  # a NaN or +inf logit makes its row's softmax NaN
        check_finite(logits.masked_fill(torch.isneginf(logits), 0.0))  # says where; -inf alone is a masked logit
    return tokens.tolist(), conf.tolist()


def accept_drafts(drafts: Sequence[int], checks: Sequence[int]) -> int:
    """Leading drafts equal to the model's greedy choice at their place (lossless verification)."""
    n = 0
    while n < len(drafts) and drafts[n] == checks[n]:
        n += 1
    return n


def cut_broken_utf8(lm: LoadedModel, generated: Sequence[int], block: Sequence[int], n: int) -> int:
    """Shorten a kept block so that no proposal after the first breaks an open UTF-8 character.

    Args:
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


@dataclass
class PassLayout:
    """The tokens one forward pass feeds and where they sit.

    ``tokens`` = ``pending`` real tokens, ``drafts`` draft tokens, then one block of ``masks_per_block``
    mask tokens for each prefix in ``blocks`` (the number of accepted drafts the block follows; block
    strategies: one block after the pending tokens). The linear layout is plain causal attention at
    consecutive positions (``positions`` and ``visible`` None). A tree layout (verification with blocks
    after several prefixes) puts block ``a``'s ``j``-th mask at the position after the ``a``-th draft plus
    ``j``, and lets it see the pending tokens, the first ``a`` drafts and its own earlier masks only.

    Attributes:
        positions: per fed token, its position offset from the first fed token (None: 0, 1, 2, ...).
        visible: ``[T, T]`` bool, which fed tokens each fed token attends to (None: causal); every
            token also sees the whole KV cache.
    """

    tokens: list[int]
    pending: int
    drafts: int
    blocks: tuple[int, ...]
    masks_per_block: int
    positions: list[int] | None = None
    visible: torch.Tensor | None = None

    @property
    def num_masks(self) -> int:
        """Mask tokens fed (all of them trailing)."""
        return len(self.blocks) * self.masks_per_block

    @property
    def logits_to_keep(self) -> int:
        """Positions whose logits the pass needs: the last pending token, each draft, each mask."""
        return 1 + self.drafts + self.num_masks


def lay_out(pending: Sequence[int], drafts: Sequence[int], strategy: Strategy, mask_token_id: int) -> PassLayout:
    """The layout of the next forward pass (:class:`PassLayout`)."""
    p, d, m = len(pending), len(drafts), strategy.num_masks
    blocks = strategy.mask_blocks(d) if strategy.verifies else (0,)  # type: ignore[attr-defined]
    if m == 0:
        blocks = ()
    tokens = list(pending) + list(drafts) + [mask_token_id] * (m * len(blocks))
    if blocks in ((), (d,)):  # masks right after the last real token: plain causal attention
        return PassLayout(tokens, p, d, blocks, m)
    t = len(tokens)
    positions = list(range(p + d))
    visible = torch.zeros(t, t, dtype=torch.bool)
    visible[: p + d, : p + d] = torch.ones(p + d, p + d, dtype=torch.bool).tril_()
    for i, a in enumerate(blocks):
        start = p + d + i * m
        positions += [p + a + j for j in range(m)]
        visible[start : start + m, : p + a] = True
        visible[start : start + m, start : start + m] = torch.ones(m, m, dtype=torch.bool).tril_()
    return PassLayout(tokens, p, d, blocks, m, positions, visible)


@dataclass
class Acceptance:
    """What the accept phase decided for one pass.

    Attributes:
        kept: the tokens to emit, before trimming.
        reason: why the block ends (see :attr:`PassRecord.block_end`).
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


def accept(lm: LoadedModel, strategy: Strategy, generated: Sequence[int], layout: PassLayout, greedy: Sequence[int],
           conf: Sequence[float], drafts: Sequence[int]) -> Acceptance:
    """The accept phase: which of a pass's proposals become output.

    Args:
        generated: tokens emitted before this pass.
        layout: the pass's :class:`PassLayout`; ``drafts``: the drafts it fed.
        greedy, conf: greedy ids and confidences at the last pending token, each draft and each mask
            (``layout.logits_to_keep`` of each).
    """
    d, m = layout.drafts, layout.masks_per_block
    if strategy.verifies:
        own = greedy[: d + 1]  # the model's token after 0, 1, ..., d accepted drafts
        a = accept_drafts(drafts, own[:d])
        nxt: list[int] = []
        if a in layout.blocks:
            i = layout.blocks.index(a)
            nxt = list(greedy[d + 1 + i * m : d + 1 + (i + 1) * m])
        rejected = a < d
        return Acceptance(list(drafts[:a]) + [own[a]], "draft rejected" if rejected else "k_max", a,
                          own[a] if rejected else None, nxt)
    n, reason = strategy.accept(conf)
    cut = cut_broken_utf8(lm, generated, greedy, n)
    if cut < n:
        n, reason = cut, "utf-8"
    return Acceptance(list(greedy[:n]), reason)


def accept_sampled(lm: LoadedModel, strategy: Strategy, generated: Sequence[int], layout: PassLayout,
                   probs: torch.Tensor, model_probs: torch.Tensor, drafts: Sequence[int],
                   draft_probs: torch.Tensor | None, sampler: TokenSampler) -> tuple[list[int], list[float], Acceptance]:
    """The accept phase when sampling (:mod:`model.engine.sampling`).

    Block strategies draw a token at the last pending token and at each mask, in order, and keep a leading run
    as :meth:`Strategy.accept` decides from the drawn tokens' probabilities under the model's own distribution
    (``model_probs``, temperature 1: tau means what it means in greedy decoding, and near temperature 0 the rule
    is greedy ConfAdapt's; a tempered probability is near 1 for every draw there). Verification accepts drafts by
    speculative sampling, then draws the tokens of the mask block after the accepted prefix, if there is one:
    the next pass's drafts, with their distributions (the other blocks are not drawn; their most likely
    tokens are recorded).

    Args:
        probs: ``[layout.logits_to_keep, V]`` sampling distributions at the last pending token, each draft and
            each mask.
        model_probs: ``[layout.logits_to_keep, V]`` the model's distributions there (softmax of the logits, the
            mask token excluded): the confidences.
        draft_probs: ``[len(drafts), V]`` the distributions the drafts were drawn from (None without drafts).

    Returns:
        ``(tokens, probabilities, acceptance)``: per position the token this pass chose there (at a draft's
        place: the draft if accepted, the replacement at the first rejected one, the most likely token after
        it; at each mask: the drawn token, or the most likely one in a block not drawn) and its probability
        under the model's distribution there (``model_probs``).
    """
    d, m = layout.drafts, layout.masks_per_block
    if not strategy.verifies:
        tokens, _ = draw_block(sampler, probs)
        conf = [float(model_probs[j, t]) for j, t in enumerate(tokens)]
        n, reason = strategy.accept(conf)
        cut = cut_broken_utf8(lm, generated, tokens, n)
        if cut < n:
            n, reason = cut, "utf-8"
        return tokens, conf, Acceptance(list(tokens[:n]), reason)
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


def trim(kept: Sequence[int], reason: str, room: int, stop_ids: set[int]) -> tuple[list[int], str, bool]:
    """The trim phase: the kept tokens up to and including the first stop token, at most ``room``
    (``max_new_tokens`` is exact). Returns ``(kept, reason, stopped)``."""
    kept = list(kept)
    if len(kept) > room:
        kept, reason = kept[:room], "max_new_tokens"
    for i, t in enumerate(kept):
        if t in stop_ids:
            return kept[: i + 1], "stop token", True
    return kept, reason, False


def cut_at_stop_string(lm: LoadedModel, generated: Sequence[int], kept: Sequence[int]) -> int | None:
    """Part of the trim phase: the number of ``kept`` tokens up to and including the one that completes
    one of :attr:`LoadedModel.stop_strings` in the answer text (None when none does; the text before
    this pass never holds one, or decoding would have stopped)."""
    if not lm.stop_strings or not kept:
        return None
    decode = lm.tokenizer.decode
    if not any(t in decode(list(generated) + list(kept)) for t in lm.stop_strings):
        return None
    for i in range(1, len(kept) + 1):
        if any(t in decode(list(generated) + list(kept[:i])) for t in lm.stop_strings):
            return i
    return None


def commit(cache: Any, fed: int, pending: int, kept: Sequence[int], verifies: bool) -> list[int]:
    """The commit phase: crop the KV cache back to the entries that stay valid — the pending tokens and,
    when verifying, the drafts that were kept (their entries are already right) — and return the kept
    tokens whose entries stay in the cache. Never a mask entry, never a rejected draft's.

    Args:
        cache: the pass's KV cache (``crop(-n)`` drops the last ``n`` entries).
        fed: tokens the pass fed; ``pending``: of which pending real tokens (first in the pass).
    """
    in_cache = list(kept[:-1]) if verifies else []
    drop = fed - pending - len(in_cache)
    if drop:
        cache.crop(-drop)
    return in_cache


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU. Timings call it before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
