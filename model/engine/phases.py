"""The phases of one forward pass (paper 3.4, 4.5; :meth:`model.engine.decoding.Decoder.run_pass` runs them in order):
the layout a pass feeds (:func:`lay_out`), **propose** (:func:`propose`), **accept** (the strategy's
:meth:`~model.engine.strategies.Strategy.accept_pass`; :mod:`model.engine.acceptance`), **trim** (:func:`trim`, :func:`cut_at_stop_string`) and **commit** (:func:`commit`), and the
checks before them (:func:`check_context_budget`, :func:`check_finite`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import ContextBudgetError, NonFiniteLogitsError
from .loaded_model import LoadedModel
from .strategies import Strategy


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


def propose(logits: torch.Tensor, mask_token_id: int, backend: Any = None) -> tuple[list[int], list[float]]:
    """Greedy proposals and their confidences for each position of one pass.

    Args:
        logits: ``[T, V]`` logits (any float dtype) at the positions that propose.
        mask_token_id: never proposed.
        backend: the backend that computed the pass (:meth:`LoadedModel.backend_of`); ours computes the proposals
            of CPU float32 / bfloat16 logits in C (:meth:`~model.engine.kernel_forward.KernelForward.propose`).

    Returns:
        ``(tokens, confidences)``: ``T`` greedy ids (the first largest logit of each row) and their top-1
        probabilities (float32 softmax over the vocabulary without the mask token).

    Raises:
        NonFiniteLogitsError: a NaN or infinite logit (the softmax would be meaningless).
    """
    fast = getattr(backend, "propose", None)
    if fast is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        tokens, conf = fast(logits, mask_token_id)
    else:
        masked = logits.to(torch.float32, copy=True)
        masked[:, mask_token_id] = float("-inf")
        tokens = masked.argmax(dim=-1).tolist()  # torch.max / argmax: the first of equal maxima
        conf = torch.softmax(masked, dim=-1).amax(dim=-1).tolist()
    if not all(math.isfinite(c) for c in conf):  # a NaN or +inf logit makes its row's softmax NaN
        masked = logits.to(torch.float32, copy=True)
        masked[:, mask_token_id] = float("-inf")
        check_finite(masked.masked_fill(torch.isneginf(masked), 0.0))  # says where; -inf alone is a masked logit
    return tokens, conf


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
    blocks = strategy.mask_blocks(d)
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


def commit(cache: Any, fed: int, pending: int, in_cache: Sequence[int]) -> None:
    """The commit phase: crop the KV cache back to the entries that stay valid — the pending tokens and the kept
    tokens whose entries the pass wrote (``in_cache``: :meth:`Strategy.cached_after`, e.g. verification's accepted
    drafts). Never a mask entry, never a rejected draft's.

    Args:
        cache: the pass's KV cache (``crop(-n)`` drops the last ``n`` entries).
        fed: tokens the pass fed; ``pending``: of which pending real tokens (first in the pass).
    """
    drop = fed - pending - len(in_cache)
    if drop:
        cache.crop(-drop)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU. Timings call it before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
