"""How fast each side of a turn ran: one timing method for every figure the page shows (DESIGN.md section 3).

Each forward pass is timed with the device synchronised while no CPU work of the page runs beside it
(:mod:`app.passes`). A side's time is its prefill plus its other passes at its typical pass; the MTP side's
typical pass is the standard side's times the median ratio of paired passes (pass i of each side ran back to
back, so a load spike or another session's work shifts both alike). A pass shared with other sessions' rows is
charged whole to each of its sequences (what each user waited for); the two sides of one turn never share one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from model.engine.decoding import PassRecord


@dataclass(frozen=True)
class SideTiming:
    """One side's time by the page's one timing method (see :class:`SpeedEstimate`).

    Attributes:
        prefill: seconds of the first pass (the prompt).
        per_pass: seconds of the side's typical later pass (None: no later pass yet).
        passes: forward passes, the prefill included.
        tokens: tokens generated.
        seconds: ``prefill + (passes - 1) * per_pass``.
        measured: the plain sum of the side's own pass times (a different measure: load spikes included).
    """

    prefill: float
    per_pass: float | None
    passes: int
    tokens: int
    seconds: float
    measured: float

    @property
    def tokens_per_second(self) -> float:
        """``tokens / seconds`` (0 before any time)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def side_timing(records: Sequence[PassRecord], per_pass: float | None = None) -> SideTiming | None:
    """A side's :class:`SideTiming` with ``per_pass`` as its typical later pass (None: the median of its own
    later passes). None before the first pass."""
    if not records:
        return None
    decode = [r.seconds for r in records[1:]]
    if per_pass is None and decode:
        per_pass = statistics.median(decode)
    prefill = records[0].seconds
    seconds = prefill + (len(records) - 1) * (per_pass or 0.0)
    return SideTiming(prefill, per_pass, len(records), sum(len(r.kept) for r in records), seconds,
                      sum(r.seconds for r in records))


@dataclass(frozen=True)
class SpeedEstimate:
    """The MTP side's speed relative to standard decoding, robust to load: the page's one timing method.

    Every pass is timed alone (device synchronised, no pass of any other session beside it). A side's time
    is its prefill plus its other passes at its typical pass: the median of all the standard side's own decode
    passes (also those it ran after the MTP side had ended), and for MTP that median times the median ratio of
    paired passes (pass i of each side ran back to back, so load hits both alike; before any pair, the median
    of its own passes). ``ratio`` = (MTP tokens / MTP time) ÷ (standard tokens / standard time); with answers
    of equal length this is the wall-clock speedup.

    Attributes:
        ratio: > 1 faster, < 1 slower.
        low, high: 90% interval from resampling the standard side's decode passes and the paired decode passes
            (None: fewer than :data:`MIN_PAIRS_FOR_INTERVAL` pairs).
        pairs: paired decode passes used.
        pass_cost: median MTP decode pass time ÷ median standard decode pass time (None: no pairs).
        raw_ratio: the same ratio from the plain sums of the passes' seconds (a different measure).
        same_length: both answers have the same number of tokens.
        standard, mtp: each side's :class:`SideTiming` (what the counters show; ``ratio`` is the ratio of
            their tokens per second).
    """

    ratio: float
    low: float | None
    high: float | None
    pairs: int
    pass_cost: float | None
    raw_ratio: float
    same_length: bool
    standard: SideTiming | None = None
    mtp: SideTiming | None = None


#: Fewest paired decode passes for an interval.
MIN_PAIRS_FOR_INTERVAL = 5


def _timings(std: Sequence[PassRecord], mtp: Sequence[PassRecord], pairs: Sequence[tuple[float, float]]
             ) -> tuple[SideTiming, SideTiming, float | None]:
    """Both sides' timings from the given pairs, and the MTP/standard pass cost (None: no pairs)."""
    if pairs:
        d_std = statistics.median(r.seconds for r in std[1:])  # all of its own passes, not the paired ones only
        cost = statistics.median(m / s for s, m in pairs)
        return side_timing(std, d_std), side_timing(mtp, d_std * cost), cost  # type: ignore[return-value]
    return side_timing(std), side_timing(mtp), None  # type: ignore[return-value]


def _ratio(t_std: SideTiming, t_mtp: SideTiming) -> float:
    return t_mtp.tokens_per_second / t_std.tokens_per_second if t_std.tokens_per_second > 0 else 0.0


def estimate_speedup(std: Sequence[PassRecord], mtp: Sequence[PassRecord], *, resamples: int = 300,
                     seed: int = 0) -> SpeedEstimate | None:
    """The MTP side's speed relative to standard decoding (see :class:`SpeedEstimate`).

    Args:
        std, mtp: the two sides' pass records (pass 0 = prefill).
        resamples: bootstrap resamples of the paired decode passes for the interval.
        seed: the resampling's seed (the same records always give the same interval).

    Returns:
        None until both sides have run a pass that produced a token.
    """
    if not std or not mtp:
        return None
    n_std, n_mtp = sum(len(r.kept) for r in std), sum(len(r.kept) for r in mtp)
    raw_std, raw_mtp = sum(r.seconds for r in std), sum(r.seconds for r in mtp)
    if n_std == 0 or n_mtp == 0 or raw_std <= 0 or raw_mtp <= 0:
        return None
    pairs = [(s.seconds, m.seconds) for s, m in zip(std[1:], mtp[1:]) if s.seconds > 0 and m.seconds > 0]
    t_std, t_mtp, cost = _timings(std, mtp, pairs)
    ratio = _ratio(t_std, t_mtp)
    low = high = None
    if len(pairs) >= MIN_PAIRS_FOR_INTERVAL:  # the same method on resampled pairs (only the medians change)
        d_std, d_mtp = _resampled_passes(pairs, [r.seconds for r in std[1:]], resamples, seed)
        boot = sorted(((n_mtp / (t_mtp.prefill + (len(mtp) - 1) * d_mtp))
                       / (n_std / (t_std.prefill + (len(std) - 1) * d_std))).tolist())
        low, high = boot[int(0.05 * (resamples - 1))], boot[int(round(0.95 * (resamples - 1)))]
    return SpeedEstimate(ratio=ratio, low=low, high=high, pairs=len(pairs), pass_cost=cost,
                         raw_ratio=(n_mtp / raw_mtp) / (n_std / raw_std), same_length=n_std == n_mtp,
                         standard=t_std, mtp=t_mtp)


def _resampled_passes(pairs: Sequence[tuple[float, float]], own: Sequence[float], resamples: int, seed: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The bootstrap of :func:`estimate_speedup`: ``(d_std, d_mtp)``, each ``[resamples]`` seconds. The standard
    side's typical pass ``d_std`` is the median of ``len(own)`` of its decode passes ``own`` drawn with
    replacement; the MTP side's ``d_mtp`` is ``d_std`` times the median MTP/standard ratio of ``len(pairs)`` pairs
    drawn with replacement. All resamples at once, as ``[resamples, n]`` tensors: a turn re-estimates its
    speed at every update of the page, and one resample at a time in Python took most of a long answer's
    rendering time, in which no forward pass runs (120 pairs: 60 ms an update on a 2-core Zen 3 VM, 4 ms now). The
    same ``seed`` gives the same values."""
    g = torch.Generator().manual_seed(seed)

    def medians(values: torch.Tensor) -> torch.Tensor:
        """Each resample's median as statistics.median takes it: of an even count, the mean of the middle two
        (torch's median is the lower one; the negated values' gives the upper)."""
        drawn = values[torch.randint(len(values), (resamples, len(values)), generator=g)]
        return (drawn.median(dim=1).values - (-drawn).median(dim=1).values) / 2

    d_std = medians(torch.tensor(list(own), dtype=torch.float64))
    cost = medians(torch.tensor([m / s for s, m in pairs], dtype=torch.float64))
    return d_std, d_std * cost


def width_pairs(std: Sequence[PassRecord], mtp: Sequence[PassRecord]) -> list[tuple[int, float]]:
    """What a turn tells about this device's width cost: for each MTP decode pass that ran back to back with a
    one-token standard pass (pass i of each side, neither sharing its pass with other sessions), ``(tokens it fed,
    its seconds over the standard pass's)``, for :meth:`app.device.ModelFacts.observe`."""
    return [(m.fed_tokens, m.seconds / s.seconds) for s, m in zip(std[1:], mtp[1:])
            if s.fed_tokens == 1 < m.fed_tokens and s.seconds > 0 and m.seconds > 0
            and s.shared_sequences == 1 and m.shared_sequences == 1]
