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
from typing import Any, Sequence

import torch

from .decoding import sync
from .loaded_model import LoadedModel

#: Acceptance by draft position assumed for an MTP-trained checkpoint with no figures of its own: about what the
#: default adapter reaches at k_max 4 (lossless effective k ~1.7).
DEFAULT_ACCEPTANCE = (0.67, 0.42, 0.22)
#: Tokens fed per pass that :func:`pass_costs` measures by default. 3 is measured, not interpolated: the widths a
#: k_max <= 4 pass feeds are where the curve bends (on AVX2, 1 + 2 masks ~1.1x a one-token pass, 1 + 3 ~1.35x).
DEFAULT_WIDTHS = (1, 2, 3, 4, 8, 16)
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
    return {w: statistics.median(t) for w, t in pass_times(lm, widths, repeats, prompt).items()}


@torch.inference_mode()
def pass_times(lm: LoadedModel, widths: Sequence[int] = DEFAULT_WIDTHS, repeats: int = 5,
               prompt: str = WIDTH_PROMPT) -> dict[int, list[float]]:
    """:func:`pass_costs`' measurements, round by round: ``{w: [seconds of round 0, round 1, ...]}``; within a
    round every width runs once, one after another (what :meth:`WidthCosts.from_rounds` pairs)."""
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
    return times


class WidthCosts:
    """What a forward pass costs by tokens fed, as a ratio to a one-token pass, from passes run back to back: load
    that comes and goes hits both passes of a pair alike, so their ratio holds still where absolute times do not.
    New pairs (:meth:`observe`: the page's own passes) refresh it; the last :data:`WINDOW` ratios of each width
    are kept. Missing widths are interpolated between measured ones (:func:`cost_at`).

    Args:
        ratios: ``{width: [ratio, ...]}`` to start from.
    """

    WINDOW = 64

    def __init__(self, ratios: dict[int, Sequence[float]] | None = None):
        self._ratios: dict[int, list[float]] = {1: [1.0]}
        for w, rs in (ratios or {}).items():
            for r in rs:
                self.observe(w, r)

    @classmethod
    def from_rounds(cls, times: dict[int, Sequence[float]]) -> "WidthCosts":
        """From :func:`pass_times`: in each round, each width's pass over that round's one-token pass."""
        ones = list(times.get(1, []))
        return cls({w: [t / one for t, one in zip(ts, ones) if one > 0] for w, ts in times.items() if w != 1})

    def observe(self, width: int, ratio: float) -> None:
        """One more pair: a pass of ``width`` tokens took ``ratio`` times a one-token pass run beside it."""
        if width < 2 or not ratio > 0 or ratio != ratio:
            return
        kept = self._ratios.setdefault(int(width), [])
        kept.append(float(ratio))
        del kept[:-self.WINDOW]

    def widths(self) -> list[int]:
        """The widths measured (1 included)."""
        return sorted(self._ratios)

    def count(self, width: int) -> int:
        """Pairs kept for ``width``."""
        return len(self._ratios.get(width, [])) if width != 1 else 0

    def costs(self) -> dict[int, float]:
        """``{width: median ratio}`` (1.0 at width 1): relative costs for :func:`verify_rate` and
        :func:`choose_verify_layout`."""
        return {w: statistics.median(rs) for w, rs in self._ratios.items()}

    def ratio(self, width: int) -> float:
        """The median cost of a ``width``-token pass over a one-token pass (interpolated between widths; 1.0 before
        any width but 1 is known)."""
        costs = self.costs()
        return cost_at(costs, width) if len(costs) > 1 else 1.0

    def spread(self, width: int) -> tuple[float, float] | None:
        """The middle half of the ratios kept for ``width`` (25th and 75th percentiles); None with fewer than 4."""
        rs = sorted(self._ratios.get(width, []))
        if len(rs) < 4 or width == 1:
            return None
        q = statistics.quantiles(rs, n=4)
        return q[0], q[2]

    def to_dict(self) -> dict:
        """Plain JSON: ``{width (str): [ratios]}``."""
        return {str(w): list(rs) for w, rs in self._ratios.items() if w != 1}

    @classmethod
    def from_dict(cls, d: dict) -> "WidthCosts":
        """Inverse of :meth:`to_dict`."""
        return cls({int(w): [float(r) for r in rs] for w, rs in d.items()})


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
                blocks: Sequence[int] | None = None, other_rows: int = 0, other_tokens: float = 0.0
                ) -> tuple[float, float]:
    """Expected ``(tokens per pass, tokens per second)`` of lossless verification at ``k_max`` with mask
    blocks after the draft prefixes in ``blocks`` (None: the linear layout, one block after all drafts).

    Two states alternate: a pass with drafts feeds the pending token, ``n = k_max - 1`` drafts and
    ``len(blocks)`` blocks of ``n`` masks, accepts ``a`` drafts with probability ``prod(p[:a]) (1 - p[a])``
    and emits ``a + 1`` tokens; the next pass has drafts when a block followed the accepted prefix. A pass
    without drafts feeds the pending token and one block of ``n`` masks, emits one token, and the next
    pass has drafts.

    With ``other_rows`` rows of other sequences in the same pass, emitting ``other_tokens`` tokens a pass, the
    speed is the pass's: every sequence's tokens over the cost of all its rows (what adding rows does to everyone).

    Args:
        costs: :func:`pass_costs` (seconds by tokens fed).
        acceptance: :func:`conditional_acceptance` by draft position (missing positions: 0).
    """
    if k_max <= 1:
        return 1.0, (1.0 + other_tokens) / cost_at(costs, other_rows + 1)
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
    seconds = (share_with * cost_at(costs, other_rows + 1 + n + len(blocks) * n)
               + (1 - share_with) * cost_at(costs, other_rows + 1 + n))
    return tokens, (tokens + other_tokens) / seconds


def choose_verify_layout(costs: dict[int, float], acceptance: Sequence[float], k_max_limit: int,
                         max_blocks_k_max: int = 8, other_rows: int = 0, other_tokens: float = 0.0
                         ) -> tuple[int, tuple[int, ...] | None, float]:
    """The lossless setting with the most expected tokens per second on this device: ``(k_max, blocks,
    speed relative to standard decoding)``; ``k_max`` 1 is standard decoding itself. Every k_max up to
    ``k_max_limit`` with the linear layout is tried, and every set of block prefixes for k_max up to
    ``max_blocks_k_max`` (2^k_max layouts each). ``other_rows`` / ``other_tokens``: the rest of a shared pass
    (:func:`verify_rate`)."""
    from itertools import combinations

    base = verify_rate(costs, acceptance, 1, None, other_rows, other_tokens)[1]
    best: tuple[float, int, tuple[int, ...] | None] = (base, 1, None)
    for k in range(2, k_max_limit + 1):
        layouts: list[tuple[int, ...] | None] = [None]
        if k <= max_blocks_k_max:
            layouts += [c for r in range(1, k + 1) for c in combinations(range(k), r) if c != (k - 1,)]
        for blocks in layouts:
            rate = verify_rate(costs, acceptance, k, blocks, other_rows, other_tokens)[1]
            if rate > best[0] * (1 + 1e-9):
                best = (rate, k, blocks)
    return best[1], best[2], best[0] / base


class AutoWidth:
    """``verify:auto``'s choice, pass by pass, of k_max and where the mask blocks go (every choice is lossless:
    only the speed depends on it).

    The layout :func:`choose_verify_layout` finds fastest *for the whole shared pass*: with ``other_rows`` rows of
    other sequences in it, emitting ``other_tokens`` tokens, a layout of ``w`` rows that emits ``t`` tokens gives
    ``(other_tokens + t) / cost(other_rows + w)``. Alone, a flat width curve makes wide trees nearly free; beside
    many sequences the same rows slow a pass that is already compute-bound for all of them, so the choice narrows
    (down to standard decoding, k_max 1, where no draft pays for its rows). Choices are cached per
    ``(limit, other rows, other tokens, acceptance)``.

    Args:
        costs: the device's :class:`WidthCosts` (kept by reference: observations refresh the choices' inputs,
            although a cached choice is only recomputed for new acceptance figures or loads).
        acceptance: the prior acceptance by draft position (share of passes that accepted draft j,
            :attr:`~model.engine.decoding.GenerationResult.acceptance_by_position`): a checkpoint's sweep, or a default.
        prior_weight: how many passes of a sequence's own the prior counts as (:meth:`acceptance_for`).
        max_tree_k_max: the largest k_max whose tree layouts are tried (2^k_max of them).
    """

    def __init__(self, costs: WidthCosts, acceptance: Sequence[float], *, prior_weight: float = 16.0,
                 max_tree_k_max: int = 6):
        self.costs, self.prior = costs, [float(a) for a in acceptance]
        self.prior_weight, self.max_tree_k_max = prior_weight, max_tree_k_max
        self._memo: dict[tuple, tuple[int, tuple[int, ...] | None]] = {}

    def acceptance_for(self, by_position: Sequence[float | None], passes: int) -> list[float]:
        """The acceptance by draft position to decide with: the prior and a sequence's own figures over ``passes``
        passes that fed drafts, weighted ``prior_weight : passes`` (rounded to 0.05, so decisions are cached)."""
        n = max(len(self.prior), len(by_position))
        out = []
        for j in range(n):
            prior = self.prior[j] if j < len(self.prior) else 0.0
            own = by_position[j] if j < len(by_position) and by_position[j] is not None else prior
            w = passes if j < len(by_position) and by_position[j] is not None else 0
            out.append(round((prior * self.prior_weight + own * w) / (self.prior_weight + w) * 20) / 20)
        return out

    def choose(self, limit: int, other_rows: int = 0, acceptance: Sequence[float] | None = None,
               other_tokens: float = 0.0) -> tuple[int, tuple[int, ...] | None]:
        """``(k_max, blocks)`` for the next pass (k_max 1: standard decoding; blocks None: linear)."""
        acc = tuple(self.prior if acceptance is None else acceptance)
        key = (int(limit), int(other_rows), round(float(other_tokens) * 2) / 2, acc)
        if key not in self._memo:
            k, blocks, _ = choose_verify_layout(self.costs.costs(), conditional_acceptance(acc), max(1, int(limit)),
                                                max_blocks_k_max=self.max_tree_k_max, other_rows=int(other_rows),
                                                other_tokens=key[2])
            self._memo[key] = (k, blocks)
        return self._memo[key]


_AUTO: dict[int, tuple[Any, AutoWidth]] = {}


def auto_width(lm: LoadedModel, acceptance: Sequence[float] | None = None) -> AutoWidth:
    """The :class:`AutoWidth` of ``lm``'s model, its width costs measured once on first use (:func:`pass_times`,
    a few seconds) and kept per model object; ``acceptance`` (default: :data:`DEFAULT_ACCEPTANCE`) is the prior."""
    entry = _AUTO.get(id(lm.model))
    if entry is None or entry[0]() is not lm.model:
        import weakref

        costs = WidthCosts.from_rounds(pass_times(lm, widths=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), repeats=5))
        entry = (weakref.ref(lm.model), AutoWidth(costs, acceptance or DEFAULT_ACCEPTANCE))
        _AUTO[id(lm.model)] = entry
    return entry[1]
