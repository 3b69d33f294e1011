"""What a forward pass costs by how many tokens it feeds, on this device (paper 4.5's premise).

MTP pays off only where a pass over several tokens costs about what a one-token pass costs: on a GPU at
batch 1, or a CPU computing in bf16 natively. On a CPU that computes in float32 (no native bf16), a pass
of 1 real token + 3 masks costs well over a one-token pass, which eats the gain of keeping more tokens
per pass. :func:`pass_costs` measures the curve once (a few passes over a short cached prompt), and
:func:`choose_verify_layout` turns it and a checkpoint's acceptance per draft position into the lossless
setting (k_max and where the mask blocks go) that decodes fastest here.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from .decoding import sync
from .loaded_model import LoadedModel

#: Tokens fed per pass that :func:`pass_costs` measures by default.
DEFAULT_WIDTHS = (1, 2, 4, 8, 16)
#: The cached prompt the width curve is measured over (a GSM8K train question).
WIDTH_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May?")


@torch.inference_mode()
def pass_costs(lm: LoadedModel, widths: Sequence[int] = DEFAULT_WIDTHS, repeats: int = 5,
               prompt: str = WIDTH_PROMPT) -> dict[int, float]:
    """Seconds of one MTP forward pass (1 real token + ``w - 1`` mask tokens, adapter on) over a cached
    prompt, for each ``w`` in ``widths``: the median of ``repeats`` passes after one warm-up, the widths
    interleaved so that load affects them alike.

    Returns:
        ``{w: seconds}``.
    """
    ids = lm.prompt_ids(prompt)
    cache = lm.new_cache()
    lm.forward(torch.tensor([ids], device=lm.device), cache, num_masks=0, logits_to_keep=1)
    last = ids[-1]

    def one(w: int) -> float:
        x = torch.tensor([[last] + [lm.mask_token_id] * (w - 1)], device=lm.device)
        sync(lm.device)
        t0 = time.perf_counter()
        lm.forward(x, cache, num_masks=w - 1, logits_to_keep=w)
        sync(lm.device)
        cache.crop(-w)
        return time.perf_counter() - t0

    for w in widths:
        one(w)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats):
        for w in widths:
            times[w].append(one(w))
    return {w: statistics.median(t) for w, t in times.items()}


def cost_at(costs: dict[int, float], width: int) -> float:
    """A pass's cost at ``width`` tokens, linearly interpolated between the measured widths (and
    extrapolated from the last two beyond them)."""
    ws = sorted(costs)
    if width in costs:
        return costs[width]
    if width < ws[0]:
        return costs[ws[0]]
    for a, b in zip(ws, ws[1:]):
        if a < width < b:
            return costs[a] + (costs[b] - costs[a]) * (width - a) / (b - a)
    a, b = ws[-2], ws[-1]
    return costs[b] + (costs[b] - costs[a]) * (width - b) / (b - a)


def conditional_acceptance(by_position: Sequence[float | None]) -> list[float]:
    """P(draft j accepted | drafts before it accepted) from the share of passes that accepted draft j
    (:attr:`~model.engine.decoding.GenerationResult.acceptance_by_position`: a draft after a rejected one
    counts as rejected, so that share is P(drafts 1..j all accepted))."""
    out, prev = [], 1.0
    for u in by_position:
        u = 0.0 if u is None else float(u)
        out.append(min(1.0, u / prev) if prev > 0 else 0.0)
        prev = u
    return out


def verify_rate(costs: dict[int, float], acceptance: Sequence[float], k_max: int,
                blocks: Sequence[int] | None = None) -> tuple[float, float]:
    """Expected ``(tokens per pass, tokens per second)`` of lossless verification at ``k_max`` with mask
    blocks after the draft prefixes in ``blocks`` (None: the linear layout, one block after all drafts).

    Two states alternate: a pass with drafts feeds the pending token, ``n = k_max - 1`` drafts and
    ``len(blocks)`` blocks of ``n`` masks, accepts ``a`` drafts with probability ``prod(p[:a]) (1 - p[a])``
    and emits ``a + 1`` tokens; the next pass has drafts when a block followed the accepted prefix. A pass
    without drafts feeds the pending token and one block of ``n`` masks, emits one token, and the next
    pass has drafts.

    Args:
        costs: :func:`pass_costs` (seconds by tokens fed).
        acceptance: :func:`conditional_acceptance` by draft position (missing positions: 0).
    """
    if k_max <= 1:
        return 1.0, 1.0 / cost_at(costs, 1)
    n = k_max - 1
    blocks = (n,) if blocks is None else tuple(blocks)
    p = [acceptance[j] if j < len(acceptance) else 0.0 for j in range(n)]
    probs, alive = [], 1.0
    for j in range(n):
        probs.append(alive * (1 - p[j]))
        alive *= p[j]
    probs.append(alive)
    again = sum(q for a, q in enumerate(probs) if a in blocks)  # P(the next pass has drafts)
    share_with = 1.0 / (2.0 - again)
    tokens = share_with * sum((a + 1) * q for a, q in enumerate(probs)) + (1 - share_with)
    seconds = share_with * cost_at(costs, 1 + n + len(blocks) * n) + (1 - share_with) * cost_at(costs, 1 + n)
    return tokens, tokens / seconds


def choose_verify_layout(costs: dict[int, float], acceptance: Sequence[float], k_max_limit: int,
                         max_blocks_k_max: int = 8) -> tuple[int, tuple[int, ...] | None, float]:
    """The lossless setting with the most expected tokens per second on this device: ``(k_max, blocks,
    speed relative to standard decoding)``; ``k_max`` 1 is standard decoding itself. Every k_max up to
    ``k_max_limit`` with the linear layout is tried, and every set of block prefixes for k_max up to
    ``max_blocks_k_max`` (2^k_max layouts each)."""
    from itertools import combinations

    base = 1.0 / cost_at(costs, 1)
    best: tuple[float, int, tuple[int, ...] | None] = (base, 1, None)
    for k in range(2, k_max_limit + 1):
        layouts: list[tuple[int, ...] | None] = [None]
        if k <= max_blocks_k_max:
            layouts += [c for r in range(1, k + 1) for c in combinations(range(k), r) if c != (k - 1,)]
        for blocks in layouts:
            rate = verify_rate(costs, acceptance, k, blocks)[1]
            if rate > best[0] * (1 + 1e-9):
                best = (rate, k, blocks)
    return best[1], best[2], best[0] / base
