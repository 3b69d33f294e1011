"""Row exactness of a forward pass: does each row of a wide pass compute what a one-token pass computes?

Lossless verification (``verify``) keeps a draft when it equals the model's greedy token *as a one-token pass
would compute it*. That holds token for token only if every row of a T-token pass has the bits of the one-token
pass of the same token after the same KV cache. :func:`row_exactness` measures it: one wide pass, then for each
row a one-token pass over a cache holding the prefix and the entries that row sees (its earlier rows in the
pass, or the tree's ancestors), compared bit for bit. ``model.bench`` prints it; the tests assert it on our
kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class RowCheck:
    """One wide pass against its one-token passes.

    Attributes:
        width: T, the tokens fed in the wide pass.
        equal: rows whose logits are bit-identical to the one-token pass.
        max_abs_diff: the largest ``|logit|`` difference over all rows (0.0 when all are equal).
    """

    width: int
    equal: int
    max_abs_diff: float

    @property
    def exact(self) -> bool:
        return self.equal == self.width


def _one_token_cache(lm, wide, pos: int, rows: Sequence[int]):
    """A cache of ``lm`` holding the first ``pos`` entries of ``wide`` and then the wide pass's entries
    ``pos + r`` for ``r`` in ``rows``, in that order."""
    cache = wide.copy_prefix(pos)
    cache.reserve(pos + len(rows))
    for j, r in enumerate(rows):
        for dst, src in ((cache.k, wide.k), (cache.v, wide.v)):
            for d, s in zip(dst, src):
                d[:, :, pos + j].copy_(s[:, :, pos + r])
    cache.length = pos + len(rows)
    return cache


@torch.no_grad()
def row_exactness(lm, prefix_ids: Sequence[int], tokens: Sequence[int], num_masks: int = 0,
                  positions: Sequence[int] | None = None, visible: torch.Tensor | None = None) -> RowCheck:
    """Compare each row of one pass over ``tokens`` (after ``prefix_ids``) with one-token passes.

    Args:
        lm: a :class:`~model.engine.loaded_model.LoadedModel` on the fast path (its caches are
            :class:`~model.engine.kv_cache.KVCache`).
        prefix_ids: the cached prefix (one prefill pass).
        tokens: the T tokens of the wide pass (real tokens, then ``num_masks`` mask tokens).
        num_masks: trailing mask tokens (the adapter's rows for an activated adapter).
        positions, visible: a tree layout as :meth:`LoadedModel.forward` takes it (None: linear, causal).

    Returns:
        A :class:`RowCheck`.

    Raises:
        ValueError: the model is not on the fast path (no KVCache).
    """
    from .kv_cache import KVCache

    cache = lm.new_cache()
    if not isinstance(cache, KVCache):
        raise ValueError("row_exactness needs the fast path (lm.new_cache() gave a transformers cache)")
    lm.forward(torch.tensor([list(prefix_ids)]), cache, 0, 1)
    pos, t = cache.length, len(tokens)
    wide = lm.forward(torch.tensor([list(tokens)]), cache, num_masks, t, positions=positions, visible=visible)[0]
    see = torch.ones(t, t, dtype=torch.bool).tril_() if visible is None else visible.to(torch.bool)
    offsets = list(range(t)) if positions is None else list(positions)
    equal, worst = 0, 0.0
    for i in range(t):
        before = [u for u in range(t) if u != i and bool(see[i, u])]
        small = _one_token_cache(lm, cache, pos, before)
        offset = pos + offsets[i] - small.length
        one = lm.forward(torch.tensor([[tokens[i]]]), small, 1 if i >= t - num_masks else 0, 1,
                         positions=[offset] if offset else None)[0, 0]
        if torch.equal(one, wide[i]):
            equal += 1
        else:
            worst = max(worst, float((one.float() - wide[i].float()).abs().max()))
    return RowCheck(t, equal, worst)
