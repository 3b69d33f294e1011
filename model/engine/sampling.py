"""Sampling settings and the random source of one request: temperature, top-k, top-p, seed.

Every strategy decodes greedily at temperature 0 (the default, today's behaviour bit for bit) and samples
otherwise:

* **standard**: the next token drawn from the model's distribution ``p`` (softmax of the logits divided by
  the temperature, then the top-k and top-p filters, renormalised; the mask token never).
* **static k / ConfAdapt**: each proposal drawn from its own position's distribution (the last real token's,
  then each mask's), in block order; static k keeps the first ``k``, ConfAdapt keeps them while the drawn
  token's probability under the model's own distribution there (:func:`model_distribution`: temperature 1,
  unfiltered) is ≥ tau (the first always). That is the rule greedy ConfAdapt applies to the top-1
  probability, and near temperature 0 it is that rule; the paper decodes greedily only (docs/DESIGN.md).
* **lossless verify** (speculative sampling, Leviathan et al. 2023, Chen et al. 2023): the drafts of a pass
  were drawn from the previous pass's mask distributions ``q``; draft ``x`` at its place is accepted with
  probability ``min(1, p(x) / q(x))``, the first rejected one replaced by a draw from the normalised
  ``max(0, p - q)``, and when every draft is accepted one more token is drawn from ``p``: each emitted token
  is distributed exactly as standard sampling's, for any ``q`` the draft was really drawn from, so every
  layout (linear and trees) is exact in distribution (tested by enumeration on a tiny model).

One :class:`TokenSampler` per request: its draws depend on its own seed and its own logits only, so a request
in a shared pass (:mod:`model.engine.batch`, whose rows are exact) equals its solo run for the same seed.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

#: The highest temperature accepted (beyond it every distribution is nearly uniform over the vocabulary).
MAX_TEMPERATURE = 5.0


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen from a position's logits.

    Attributes:
        temperature: 0 = greedy (argmax); otherwise logits are divided by it before the softmax.
        top_p: nucleus filter: the smallest set of most likely tokens whose probability reaches ``top_p``
            (1 = off).
        top_k: keep the ``top_k`` most likely tokens (0 = off).
        seed: the request's random seed (None: a fresh one per request, reported in its result).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """True at temperature 0: argmax decoding, the other settings unused."""
        return self.temperature == 0

    @property
    def label(self) -> str:
        """Human label, e.g. ``greedy`` or ``temperature 0.7, top-p 0.95``."""
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        """JSON-ready settings."""
        return asdict(self)

    def probabilities(self, logits: torch.Tensor, mask_token_id: int | None = None) -> torch.Tensor:
        """The sampling distribution at each position.

        Args:
            logits: ``[T, V]`` logits (any float dtype; finite).
            mask_token_id: never drawn (probability 0).

        Returns:
            ``[T, V]`` float32 probabilities: softmax(logits / temperature), restricted to the top-k and to the
            top-p nucleus (the most likely token always stays), renormalised.

        Raises:
            ValueError: at temperature 0 (greedy decoding draws nothing).
        """
        if self.greedy:
            raise ValueError("Greedy decoding (temperature 0) has no sampling distribution.")
        z = _without_mask(logits.float() / self.temperature, mask_token_id)
        if self.top_k and self.top_k < z.shape[-1]:
            kth = torch.topk(z, self.top_k, dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        probs = torch.softmax(z, dim=-1)
        if self.top_p < 1:
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the more likely tokens
            drop = before >= self.top_p  # the most likely token has 0 before it: always kept
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


def parse_sampling(temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None) -> Sampling:
    """Checked :class:`Sampling` from user input (CLI, page, API; None means the default).

    Raises:
        ValueError: temperature outside [0, :data:`MAX_TEMPERATURE`], top-p outside (0, 1], top-k not a whole
            number ≥ 0, a seed that is not a whole number ≥ 0; the message names the setting.
    """
    def number(value: Any, name: str, default: float) -> float:
        if value is None or (isinstance(value, str) and not value.strip()):
            return default
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}.") from None
        if math.isnan(f):
            raise ValueError(f"{name} must be a number, got {value!r}.")
        return f

    t = number(temperature, "The temperature", 0.0)
    if not 0 <= t <= MAX_TEMPERATURE:
        raise ValueError(f"The temperature must be from 0 (greedy) to {MAX_TEMPERATURE:g}, got {temperature!r}.")
    p = number(top_p, "top-p", 1.0)
    if not 0 < p <= 1:
        raise ValueError(f"top-p must be in (0, 1] (1 = off), got {top_p!r}.")
    k = number(top_k, "top-k", 0)
    if k < 0 or k != int(k):
        raise ValueError(f"top-k must be a whole number ≥ 0 (0 = off), got {top_k!r}.")
    s = None if seed is None or (isinstance(seed, str) and not seed.strip()) else number(seed, "The seed", 0)
    if s is not None and (s < 0 or s != int(s) or s >= 2 ** 63):
        raise ValueError(f"The seed must be a whole number ≥ 0, got {seed!r}.")
    return Sampling(temperature=t, top_p=p, top_k=int(k), seed=None if s is None else int(s))


GREEDY = Sampling()


class TokenSampler:
    """The random source of one request: a torch generator seeded once, whose draws depend on nothing else.

    Args:
        seed: the seed; None draws one from the operating system (``seed`` says which, so the run can be
            repeated).
    """

    def __init__(self, seed: int | None = None):
        self.seed = int.from_bytes(os.urandom(8), "big") >> 1 if seed is None else int(seed)
        self.generator = torch.Generator().manual_seed(self.seed)

    def draw(self, probs: torch.Tensor) -> int:
        """One token id drawn from ``probs`` (``[V]``, non-negative, summing to about 1): inverse transform
        sampling, the first token whose running sum (float64) exceeds ``u`` times the total, ``u`` uniform in
        [0, 1). A token of probability 0 is never drawn. (``torch.multinomial`` draws the same distribution but
        takes ~1.3 ms on a 49k vocabulary against ~0.05 ms here: a sampled pass draws up to k_max + 1 tokens.)"""
        cdf = torch.cumsum(probs.double(), 0)
        u = torch.rand((), generator=self.generator, dtype=torch.float64) * cdf[-1]
        i = int(torch.searchsorted(cdf, u, right=True))
        return i if i < cdf.numel() else int(torch.nonzero(probs).max())  # u * total rounded up to the total

    def coin(self, p: float) -> bool:
        """True with probability ``p``."""
        return bool(torch.rand((), generator=self.generator) < p)


def model_distribution(logits: torch.Tensor, mask_token_id: int | None = None) -> torch.Tensor:
    """The model's own distribution at each position, ``[T, V]`` float32: softmax of the logits at temperature 1,
    unfiltered, the mask token excluded (what greedy confidences are the top of; ConfAdapt compares tau with it
    under sampling too)."""
    return torch.softmax(_without_mask(logits.float().clone(), mask_token_id), dim=-1)


def _without_mask(z: torch.Tensor, mask_token_id: int | None) -> torch.Tensor:
    """``z`` (logits, modified in place) with the mask token's set to -inf: it is never drawn nor counted."""
    if mask_token_id is not None and mask_token_id < z.shape[-1]:
        z[..., mask_token_id] = float("-inf")
    return z


def draw_block(sampler: TokenSampler, probs: torch.Tensor) -> tuple[list[int], list[float]]:
    """One token drawn from each row of ``probs`` (``[T, V]``), in row order; returns the tokens and each one's
    probability under its row."""
    tokens = [sampler.draw(row) for row in probs]
    return tokens, [float(probs[i, t]) for i, t in enumerate(tokens)]


def speculative_accept(sampler: TokenSampler, drafts: Sequence[int], target: torch.Tensor,
                       draft_probs: torch.Tensor) -> tuple[int, int, list[float]]:
    """Speculative sampling over one pass's drafts.

    Args:
        drafts: ``d`` draft ids, draft ``j`` drawn from ``draft_probs[j]``.
        target: ``[d + 1, V]`` the model's distribution at each draft's place and after the last draft.
        draft_probs: ``[d, V]`` the distributions the drafts were drawn from.

    Returns:
        ``(accepted, token, ratios)``: how many leading drafts are accepted, the token that follows them (a
        draw from the normalised ``max(0, p - q)`` at the first rejected draft's place, or from ``p`` after
        the last draft), and each examined draft's acceptance probability ``min(1, p(x) / q(x))``.
    """
    ratios: list[float] = []
    for j, x in enumerate(drafts):
        p, q = float(target[j, x]), float(draft_probs[j, x])
        ratio = min(1.0, p / q) if q > 0 else 0.0
        ratios.append(ratio)
        if not sampler.coin(ratio):
            residual = (target[j] - draft_probs[j]).clamp_(min=0)
            total = float(residual.sum())
            return j, sampler.draw(residual / total if total > 0 else target[j]), ratios
    return len(drafts), sampler.draw(target[len(drafts)]), ratios


def add_sampling_arguments(parser: Any) -> None:
    """``--temperature``, ``--top-p``, ``--top-k`` and ``--seed`` on an ``argparse`` parser (the CLIs share them)."""
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default); otherwise sample at this temperature (up to 5)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="random seed of the first request (request i uses seed + i); default: a fresh one each")


def sampling_from_args(args: Any) -> Sampling:
    """The checked :class:`Sampling` of parsed :func:`add_sampling_arguments` options.

    Raises:
        ValueError: as :func:`parse_sampling`.
    """
    return parse_sampling(args.temperature, args.top_p, args.top_k, args.seed)


def for_request(sampling: Sampling, index: int) -> Sampling:
    """The settings of the ``index``-th request of a run: the seed advanced by ``index`` (a fixed seed gives every
    request its own stream, the same on a rerun); no seed stays no seed (a fresh one per request)."""
    if sampling.greedy or sampling.seed is None:
        return sampling
    return Sampling(sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed + index)
