"""The types of a speed/quality sweep (:mod:`model.evaluation.sweep`) and of the page's answers drawn beside it.

A :class:`Sweep` holds one :class:`SweepPoint` per strategy, its strategy spec parsed once into a
:class:`~model.engine.strategies.Strategy`; :meth:`Sweep.to_dict` / :meth:`Sweep.from_dict` are the ``sweep.json``
format. An :class:`AnswerPoint` is one finished answer of the page, drawn beside the sweep. Plain data only: no
model code here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping

from ..engine.strategies import Strategy, Verify, parse_tau, resolve_strategy


# ----------------------------------------------------------------------------- checking plain values
def _number(d: Mapping, key: str, *, optional: bool = True) -> float | None:
    """``d[key]`` as a finite float (None when absent or null and ``optional``). Raises ValueError."""
    value = d.get(key)
    if value is None:
        if optional:
            return None
        raise ValueError(f"A sweep point needs {key!r}.")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key!r} must be a finite number, got {value!r}.")
    return float(value)


def _whole(d: Mapping, key: str) -> int | None:
    """``d[key]`` as an int, or None when absent or null. Raises ValueError."""
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{key!r} must be a whole number, got {value!r}.")
    return int(value)


def _text(d: Mapping, key: str) -> str | None:
    """``d[key]`` as a string, or None when absent or null. Raises ValueError."""
    value = d.get(key)
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{key!r} must be a string, got {value!r}.")


# ----------------------------------------------------------------------------- the types
@dataclass(frozen=True)
class SweepPoint:
    """One strategy of a sweep: what it measured on the sweep's prompts.

    Attributes:
        strategy: the strategy, parsed once from its spec (:func:`~model.engine.strategies.resolve_strategy`);
            :attr:`name`, :attr:`label`, :attr:`tau`, :attr:`k_max`, :attr:`k`, :attr:`layout` and
            :attr:`linear_verify` read it.
        effective_k: tokens per forward pass (mean over passes).
        agreement_with_standard: share (0..1) of answers identical to standard decoding's.
        nll_teacher: mean negative log-likelihood of the answers under the teacher (the base model, adapter
            off), nats per token; None when nothing was scored.
        accuracy: share (0..1) of problems answered correctly; None without gold answers (:func:`run_sweep`).
        draft_acceptance_rate: accepted ÷ proposed drafts (lossless verification only, else None).
        acceptance_by_position: per draft position, the share of passes that proposed that draft in which it
            was accepted (lossless verification only, else None); an entry may be None.
    """

    strategy: Strategy
    effective_k: float
    agreement_with_standard: float | None = None
    nll_teacher: float | None = None
    accuracy: float | None = None
    draft_acceptance_rate: float | None = None
    acceptance_by_position: tuple[float | None, ...] | None = None

    @property
    def spec(self) -> str:
        """The strategy's spec, e.g. ``verify:4:full`` (the file's ``strategy``)."""
        return self.strategy.spec

    @property
    def name(self) -> str:
        """``standard``, ``static``, ``confadapt`` or ``verify``."""
        return self.strategy.name

    @property
    def label(self) -> str:
        """The strategy in words, e.g. ``ConfAdapt tau=0.90 k_max=4``."""
        return self.strategy.label

    @property
    def tau(self) -> float | None:
        """ConfAdapt's threshold (None for the others)."""
        return self.strategy.tau

    @property
    def k_max(self) -> int:
        """Proposals per forward pass."""
        return self.strategy.k_max

    @property
    def k(self) -> int | None:
        """Static k's block size (None for the others)."""
        return self.strategy.k

    @property
    def layout(self) -> str | None:
        """Lossless verification's mask-block layout (``linear``, ``full``, ``0/1/3``); None for the others."""
        return self.strategy.layout if isinstance(self.strategy, Verify) else None

    @property
    def linear_verify(self) -> bool:
        """Lossless verification with the linear layout (one mask block after all drafts)."""
        return self.layout == "linear"

    def to_dict(self) -> dict:
        """The point as ``sweep.json`` writes it: ``{"strategy" (the spec), "name", "label", "tau", "k_max",
        "k", "effective_k", "agreement_with_standard", "nll_teacher", "accuracy", "draft_acceptance_rate",
        "acceptance_by_position" (a list or None)}``."""
        by_pos = None if self.acceptance_by_position is None else list(self.acceptance_by_position)
        return {"strategy": self.spec, "name": self.name, "label": self.label, "tau": self.tau, "k_max": self.k_max,
                "k": self.k, "effective_k": self.effective_k, "agreement_with_standard": self.agreement_with_standard,
                "nll_teacher": self.nll_teacher, "accuracy": self.accuracy,
                "draft_acceptance_rate": self.draft_acceptance_rate, "acceptance_by_position": by_pos}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SweepPoint":
        """Inverse of :meth:`to_dict`: the spec in ``strategy`` is parsed; ``name``, ``tau`` and ``k_max``, when
        given, must agree with it (``label`` and ``k`` are read from the strategy). Absent measurements are None.

        Raises:
            ValueError: not a mapping, no or a bad ``strategy`` spec, a field that disagrees with it, a missing
                ``effective_k``, or a value of the wrong type.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"A sweep point is a mapping, got {type(d).__name__}.")
        spec = _text(d, "strategy")
        if not spec:
            raise ValueError("A sweep point needs its 'strategy' spec.")
        strategy = resolve_strategy(spec)
        for key in ("name", "k_max"):
            given = d.get(key)
            if given is not None and given != getattr(strategy, key):
                raise ValueError(f"Sweep point {spec!r}: {key} {given!r} disagrees with the spec "
                                 f"({getattr(strategy, key)!r}).")
        tau = _number(d, "tau")
        if tau is not None:  # the spec writes tau to 6 digits (``:g``); the field holds it whole
            if strategy.tau is None or not math.isclose(tau, strategy.tau, rel_tol=1e-5, abs_tol=1e-9):
                raise ValueError(f"Sweep point {spec!r}: tau {tau!r} disagrees with the spec ({strategy.tau!r}).")
            strategy = dataclasses.replace(strategy, tau=parse_tau(tau))
        by_pos = d.get("acceptance_by_position")
        if by_pos is not None:
            if not isinstance(by_pos, (list, tuple)):
                raise ValueError(f"'acceptance_by_position' must be a list, got {by_pos!r}.")
            by_pos = tuple(_number({"acceptance_by_position": a}, "acceptance_by_position") for a in by_pos)
        return cls(strategy, _number(d, "effective_k", optional=False),  # type: ignore[arg-type]
                   _number(d, "agreement_with_standard"), _number(d, "nll_teacher"), _number(d, "accuracy"),
                   _number(d, "draft_acceptance_rate"), by_pos)


@dataclass(frozen=True)
class Sweep:
    """A checkpoint's speed/quality trade-off: one :class:`SweepPoint` per strategy, and what it was measured on.

    Attributes:
        model: the model measured (its source, e.g. ``smollm2-135m``); None when not recorded.
        data: the prompts' file (``prompts`` for :func:`run_sweep`'s own prompts); None when not recorded.
        n_prompts: prompts (or problems) each strategy answered; None when not recorded.
        max_new_tokens: the token limit of each answer; None when not recorded.
        dtype: the dtype the weights computed in, e.g. ``float32``; None when not recorded.
        points: the strategies' points, in the order measured (standard decoding first when measured).
    """

    model: str | None
    data: str | None
    n_prompts: int | None
    max_new_tokens: int | None
    dtype: str | None
    points: tuple[SweepPoint, ...]

    def named(self, name: str) -> tuple[SweepPoint, ...]:
        """The points of the strategies called ``name`` (``standard``, ``static``, ``confadapt``, ``verify``)."""
        return tuple(p for p in self.points if p.name == name)

    def to_dict(self) -> dict:
        """``sweep.json``'s content: ``{"model", "data", "n_prompts", "max_new_tokens", "dtype", "points":
        [SweepPoint.to_dict(), ...]}`` (plain JSON values)."""
        return {"model": self.model, "data": self.data, "n_prompts": self.n_prompts,
                "max_new_tokens": self.max_new_tokens, "dtype": self.dtype,
                "points": [p.to_dict() for p in self.points]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Sweep":
        """Inverse of :meth:`to_dict` (absent descriptive fields are None).

        Raises:
            ValueError: not a mapping, ``points`` not a list, or a bad point (:meth:`SweepPoint.from_dict`).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"A sweep is a mapping, got {type(d).__name__}.")
        points = d.get("points")
        if not isinstance(points, (list, tuple)):
            raise ValueError("A sweep needs a list of 'points'.")
        return cls(_text(d, "model"), _text(d, "data"), _whole(d, "n_prompts"), _whole(d, "max_new_tokens"),
                   _text(d, "dtype"), tuple(SweepPoint.from_dict(p) for p in points))


@dataclass(frozen=True)
class AnswerPoint:
    """One finished answer of the page, a point of the trade-off figure beside the sweep. Plain data: it
    pickles (a ZeroGPU worker sends it between processes).

    Attributes:
        model_key: the model that answered, ``(source, quantization, precision)``.
        turn: the turn's number in its conversation (1 for the first).
        label: the strategy in words (``Strategy.label``).
        name: the strategy's name (``standard``, ``static``, ``confadapt``, ``verify``).
        tau: ConfAdapt's threshold (None for the others).
        effective_k: tokens per forward pass of the answer.
        identical: the answer is identical to standard decoding's.
        parted_at: the index of the first token where it differs from standard decoding's (None when
            identical).
        nll: the answer's mean negative log-likelihood under the model, adapter off, nats per token (None when
            not scored).
        standard_nll: the same for standard decoding's answer (None when not scored).
        repeats: the answer degenerates into repetition.
        sampled: both sides sampled (temperature above 0): ``identical`` and ``parted_at`` compare two draws, not
            two decodings.
    """

    model_key: tuple[str, ...]
    turn: int
    label: str
    name: str
    tau: float | None
    effective_k: float
    identical: bool
    parted_at: int | None = None
    nll: float | None = None
    standard_nll: float | None = None
    repeats: bool = False
    sampled: bool = False

    def to_dict(self) -> dict:
        """Plain values: ``{"model_key" (a list), "turn", "label", "name", "tau", "effective_k", "identical",
        "parted_at", "nll", "standard_nll", "repeats", "sampled"}``."""
        return {"model_key": list(self.model_key), "turn": self.turn, "label": self.label, "name": self.name,
                "tau": self.tau, "effective_k": self.effective_k, "identical": self.identical,
                "parted_at": self.parted_at, "nll": self.nll, "standard_nll": self.standard_nll,
                "repeats": self.repeats, "sampled": self.sampled}

    @classmethod
    def from_dict(cls, d: Mapping) -> "AnswerPoint":
        """Inverse of :meth:`to_dict`; ``tau``, ``parted_at``, ``nll`` and ``standard_nll`` may be absent (None),
        ``repeats`` and ``sampled`` too (False).

        Raises:
            ValueError: not a mapping, a missing ``model_key``, ``turn``, ``label``, ``name``, ``effective_k`` or
                ``identical``, or a value of the wrong type.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"An answer point is a mapping, got {type(d).__name__}.")
        missing = [k for k in ("model_key", "turn", "label", "name", "effective_k", "identical") if d.get(k) is None]
        if missing:
            raise ValueError(f"An answer point needs {', '.join(map(repr, missing))}.")
        key = d["model_key"]
        if isinstance(key, str) or not isinstance(key, (list, tuple)) or not all(isinstance(x, str) for x in key):
            raise ValueError(f"'model_key' must be a list of strings, got {key!r}.")
        return cls(tuple(key), _whole(d, "turn"), _text(d, "label"), _text(d, "name"),  # type: ignore[arg-type]
                   _number(d, "tau"), _number(d, "effective_k", optional=False),  # type: ignore[arg-type]
                   bool(d["identical"]), _whole(d, "parted_at"), _number(d, "nll"), _number(d, "standard_nll"),
                   bool(d.get("repeats", False)), bool(d.get("sampled", False)))
