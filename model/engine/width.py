"""What a forward pass costs by how many tokens it feeds, on this device (paper 4.5's premise).

MTP pays off only where a pass over several tokens costs about what a one-token pass costs: on a GPU at
batch 1, or a CPU computing in bf16 natively. On a CPU that computes in float32 (no native bf16), a pass
of 1 real token + 3 masks costs well over a one-token pass, which eats the gain of keeping more tokens
per pass. :func:`pass_costs` measures the curve once (a few passes over a short cached prompt), and
:func:`best_lossless_k_max` turns it and a checkpoint's acceptance per draft position into the lossless
setting that decodes fastest here.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from .loaded_model import LoadedModel

#: Tokens fed per pass that :func:`pass_costs` measures by default.
DEFAULT_WIDTHS = (1, 2, 4, 8, 16)
_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def pass_costs(lm: LoadedModel, widths: Sequence[int] = DEFAULT_WIDTHS, repeats: int = 5,
               prompt: str = _PROMPT) -> dict[int, float]:
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
        _sync(lm.device)
        t0 = time.perf_counter()
        lm.forward(x, cache, num_masks=w - 1, logits_to_keep=w)
        _sync(lm.device)
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


def lossless_tokens_per_second(costs: dict[int, float], acceptance: Sequence[float], k_max: int) -> float:
    """Expected tokens per second of linear lossless verification at ``k_max`` (a pass feeds the pending
    token, ``k_max - 1`` drafts and ``k_max - 1`` masks; after a rejection the next pass has no drafts).

    Args:
        costs: :func:`pass_costs`.
        acceptance: P(draft j accepted | drafts before it accepted), j = 1, 2, ... (missing positions: 0).
    """
    if k_max <= 1:
        return 1.0 / cost_at(costs, 1)
    n = k_max - 1
    p = [acceptance[j] if j < len(acceptance) else 0.0 for j in range(n)]
    # P(exactly a drafts accepted of n)
    probs, alive = [], 1.0
    for j in range(n):
        probs.append(alive * (1 - p[j]))
        alive *= p[j]
    probs.append(alive)
    full = probs[-1]  # every draft accepted: the next pass has drafts again
    tokens_with = sum((a + 1) * q for a, q in enumerate(probs))
    # Two states: with drafts (pass of 1 + 2n tokens), without (1 + n: the masks only).
    # From "without", the next pass always has drafts; from "with", it has drafts with probability `full`.
    share_with = 1.0 / (2.0 - full)
    share_without = 1.0 - share_with
    tokens = share_with * tokens_with + share_without * 1.0
    seconds = share_with * cost_at(costs, 1 + 2 * n) + share_without * cost_at(costs, 1 + n)
    return tokens / seconds


def best_lossless_k_max(costs: dict[int, float], acceptance: Sequence[float], k_max_limit: int) -> tuple[int, float]:
    """The lossless k_max (1 = standard decoding) with the most expected tokens per second, and that rate
    relative to standard decoding's."""
    base = 1.0 / cost_at(costs, 1)
    best = max(range(1, k_max_limit + 1), key=lambda k: lossless_tokens_per_second(costs, acceptance, k))
    return best, lossless_tokens_per_second(costs, acceptance, best) / base
