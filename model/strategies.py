"""Decoding strategies: which of a forward pass's proposals become output (paper 3.4, 4.5).

The one vocabulary of strategies that the CLI, the app, the evaluation, the benchmark and the
lm-eval model share: their names, parameters, defaults, caps, labels and spec strings are written
here once.

=============  ===========================  =======================================================
spec           class                        a forward pass keeps
=============  ===========================  =======================================================
``standard``   :class:`Standard`            one token, no mask tokens fed (the baseline)
``static:K``   :class:`StaticK`             the first ``K`` proposals (``k_max = K``)
``confadapt:   :class:`ConfAdapt`           the longest leading run of proposals whose confidence
TAU[:K_MAX]``                               is ≥ tau, always at least the first
``verify       :class:`Verify`              the drafts fed from the previous pass that equal the
[:K_MAX]``                                  model's own greedy choice, plus its next token
                                            (lossless: output == standard decoding)
=============  ===========================  =======================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

DEFAULT_K_MAX = 16  # proposals per forward pass when nothing else says (the paper's sweep uses 16)
MAX_K_MAX = 64  # the largest k_max accepted anywhere (engine, CLI, app)
DEFAULT_TAU = 0.9  # ConfAdapt's default threshold (the paper's headline operating point)
DEFAULT_STATIC_K = 3  # static k's default block size (the paper's best static k on GSM8K)


# ----------------------------------------------------------------------------- argument parsing
def parse_whole_number(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]``: ints, integral floats (``3.0``) and numeric strings pass.

    Raises:
        ValueError: not a whole number, or out of range; the message names ``name`` and the range.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number, got {value!r}.") from None
    if not math.isfinite(f) or f != int(f):
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    n = int(f)
    if n < lo or (hi is not None and n > hi):
        bounds = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        raise ValueError(f"{name} must be {bounds}, got {n}.")
    return n


def parse_tau(value: Any) -> float:
    """The ConfAdapt threshold tau as a float in [0, 1].

    Raises:
        ValueError: not a number, NaN, or outside [0, 1].
    """
    try:
        tau = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"The threshold tau must be a number in [0, 1], got {value!r}.") from None
    if math.isnan(tau) or not 0.0 <= tau <= 1.0:
        raise ValueError(f"The threshold tau must be in [0, 1], got {value!r}.")
    return tau


def check_max_new_tokens(value: Any, upper: int | None = None) -> int:
    """``max_new_tokens`` as an int ≥ 1 (and ≤ ``upper`` when given). Raises ValueError."""
    return parse_whole_number(value, "max_new_tokens", 1, upper)


def check_k_max(value: Any) -> int:
    """``k_max`` as an int in 1 .. :data:`MAX_K_MAX`. Raises ValueError."""
    return parse_whole_number(value, "k_max", 1, MAX_K_MAX)


# ----------------------------------------------------------------------------- strategies
class Strategy:
    """Base of the strategies. Subclasses are frozen dataclasses; compare and hash by value.

    Class attributes:
        name: the spec keyword (``standard``, ``static``, ``confadapt``, ``verify``).
        verifies: True when a pass checks drafts fed as real tokens (lossless decoding).

    Attributes:
        k_max: proposals per forward pass; a pass feeds ``k_max - 1`` mask tokens.
        tau: ConfAdapt's threshold (None for the others).
        k: static k's block size (None for the others).
    """

    name: ClassVar[str] = ""
    verifies: ClassVar[bool] = False
    k_max: int
    tau: float | None = None
    k: int | None = None

    @property
    def num_masks(self) -> int:
        """Mask tokens appended to each forward pass: ``k_max - 1``."""
        return self.k_max - 1

    @property
    def lookahead(self) -> int:
        """Positions a pass may use past the tokens already emitted (drafts + masks)."""
        return self.num_masks * (2 if self.verifies else 1)

    def accept(self, confidences: Sequence[float]) -> tuple[int, str]:
        """How many leading proposals of a block to keep, and why the block ends there.

        Args:
            confidences: the ``k_max`` top-1 probabilities of one pass, in block order.

        Returns:
            ``(n, reason)`` with ``1 ≤ n ≤ len(confidences)``; ``reason`` is ``"k_max"`` when every
            proposal was kept.
        """
        raise NotImplementedError

    @property
    def label(self) -> str:
        """Human label, e.g. ``ConfAdapt tau=0.90 k_max=16``."""
        raise NotImplementedError

    @property
    def spec(self) -> str:
        """The string :func:`parse_strategy` reads back, e.g. ``confadapt:0.9:16``."""
        raise NotImplementedError


@dataclass(frozen=True)
class Standard(Strategy):
    """Next-token prediction: one token per forward pass, no mask tokens."""

    name: ClassVar[str] = "standard"
    k_max: int = 1

    def accept(self, confidences: Sequence[float]) -> tuple[int, str]:  # noqa: D102 - see Strategy
        return 1, "k_max"

    @property
    def label(self) -> str:  # noqa: D102
        return "standard"

    @property
    def spec(self) -> str:  # noqa: D102
        return "standard"


@dataclass(frozen=True)
class StaticK(Strategy):
    """Keep exactly the first ``k`` proposals of every pass (paper 4.5, "static"); ``k_max = k``."""

    name: ClassVar[str] = "static"
    k: int = DEFAULT_STATIC_K  # type: ignore[assignment]

    @property
    def k_max(self) -> int:  # type: ignore[override]
        """Static k feeds ``k - 1`` masks: ``k_max = k``."""
        return self.k

    def accept(self, confidences: Sequence[float]) -> tuple[int, str]:  # noqa: D102
        return min(self.k, len(confidences)), "k_max"

    @property
    def label(self) -> str:  # noqa: D102
        return f"static k={self.k}"

    @property
    def spec(self) -> str:  # noqa: D102
        return f"static:{self.k}"


@dataclass(frozen=True)
class ConfAdapt(Strategy):
    """ConfAdapt (paper 4.5): keep the longest leading run of proposals with confidence ≥ tau; the
    first proposal is always kept, whatever its confidence."""

    name: ClassVar[str] = "confadapt"
    tau: float = DEFAULT_TAU  # type: ignore[assignment]
    k_max: int = DEFAULT_K_MAX

    def accept(self, confidences: Sequence[float]) -> tuple[int, str]:  # noqa: D102
        n = 1
        while n < len(confidences) and confidences[n] >= self.tau:
            n += 1
        return n, ("k_max" if n == len(confidences) else "below tau")

    @property
    def label(self) -> str:  # noqa: D102
        return f"ConfAdapt tau={self.tau:.2f} k_max={self.k_max}"

    @property
    def spec(self) -> str:  # noqa: D102
        return f"confadapt:{self.tau:g}:{self.k_max}"


@dataclass(frozen=True)
class Verify(Strategy):
    """Lossless self-speculative decoding: the mask proposals of one pass are fed as real tokens
    (drafts) in the next and kept while they equal the model's own greedy choice, plus the model's
    next token (see :mod:`model.decoding`). Output == standard decoding of the same model."""

    name: ClassVar[str] = "verify"
    verifies: ClassVar[bool] = True
    k_max: int = DEFAULT_K_MAX

    def accept(self, confidences: Sequence[float]) -> tuple[int, str]:  # noqa: D102
        return 1, "k_max"  # the block of a verify pass is decided by the drafts, not by confidence

    @property
    def label(self) -> str:  # noqa: D102
        return f"lossless verify k_max={self.k_max}"

    @property
    def spec(self) -> str:  # noqa: D102
        return f"verify:{self.k_max}"


STRATEGY_NAMES = ("standard", "static", "confadapt", "verify")
SPEC_HELP = "standard, static:K, confadapt:TAU[:K_MAX] or verify[:K_MAX]"


def standard() -> Standard:
    """Next-token prediction, one token per forward pass (the baseline)."""
    return Standard()


def static_k(k: Any, k_max: Any = None) -> StaticK:
    """Static k (paper 4.5).

    Raises:
        ValueError: ``k`` not in 1 .. :data:`MAX_K_MAX`, or ``k > k_max`` when ``k_max`` is given.
    """
    k = parse_whole_number(k, "k", 1, MAX_K_MAX)
    if k_max is not None and k > check_k_max(k_max):
        raise ValueError(f"k ({k}) cannot exceed k_max ({k_max}).")
    return StaticK(k=k)


def confadapt(tau: Any = DEFAULT_TAU, k_max: Any = DEFAULT_K_MAX) -> ConfAdapt:
    """ConfAdapt with threshold ``tau`` and ``k_max`` proposals per pass (paper 4.5).

    Raises:
        ValueError: tau outside [0, 1]; k_max not in 1 .. :data:`MAX_K_MAX`.
    """
    return ConfAdapt(tau=parse_tau(tau), k_max=check_k_max(k_max))


def verify(k_max: Any = DEFAULT_K_MAX) -> Verify:
    """Lossless verification of mask drafts, ``k_max - 1`` drafts at most per pass.

    Raises:
        ValueError: k_max not in 1 .. :data:`MAX_K_MAX`.
    """
    return Verify(k_max=check_k_max(k_max))


def make_strategy(name: Any, *, tau: Any = DEFAULT_TAU, k_max: Any = None, k: Any = DEFAULT_STATIC_K) -> Strategy:
    """A strategy from separate arguments (CLI flags, app controls); only the ones it uses are checked.

    Args:
        name: ``standard``, ``static``, ``confadapt`` or ``verify`` (case and spaces ignored;
            the app's labels ``static k`` and ``lossless`` are accepted too).
        tau: ConfAdapt's threshold.
        k_max: proposals per pass for ConfAdapt / verify (None: :data:`DEFAULT_K_MAX`); for static k,
            when given, an upper bound that ``k`` must respect.
        k: static k's block size.

    Raises:
        ValueError: an unknown name or an invalid parameter, with a message naming it.
    """
    key = str(name or "").strip().lower().replace(" ", "")
    key = {"statick": "static", "lossless": "verify"}.get(key, key)
    if key == "standard":
        return standard()
    if key == "static":
        return static_k(k, k_max)
    if key == "confadapt":
        return confadapt(tau, DEFAULT_K_MAX if k_max is None else k_max)
    if key == "verify":
        return verify(DEFAULT_K_MAX if k_max is None else k_max)
    raise ValueError(f"Unknown strategy {name!r}: use {', '.join(STRATEGY_NAMES)}.")


def parse_strategy(spec: str, default_k_max: int = DEFAULT_K_MAX) -> Strategy:
    """Parse one spec: ``standard``, ``static:K``, ``confadapt:TAU[:K_MAX]``, ``verify[:K_MAX]``.

    Raises:
        ValueError: a malformed spec, with the accepted forms.
    """
    parts = str(spec).strip().lower().split(":")
    head, args = parts[0], parts[1:]
    try:
        if head == "standard" and not args:
            return standard()
        if head == "static" and len(args) == 1:
            return static_k(args[0])
        if head == "confadapt" and len(args) in (1, 2):
            return confadapt(args[0], args[1] if len(args) == 2 else default_k_max)
        if head == "verify" and len(args) <= 1:
            return verify(args[0] if args else default_k_max)
    except ValueError as e:
        raise ValueError(f"Bad strategy {spec!r}: {e}") from None
    raise ValueError(f"Bad strategy {spec!r}: use {SPEC_HELP}.")


def parse_strategies(specs: str | Sequence[str], default_k_max: int = DEFAULT_K_MAX) -> list[Strategy]:
    """Parse a comma-separated list (or a list) of specs; duplicates are dropped, order kept.

    Raises:
        ValueError: an empty list or a malformed spec.
    """
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    out: list[Strategy] = []
    for s in items:
        if s.strip():
            st = parse_strategy(s, default_k_max)
            if st not in out:
                out.append(st)
    if not out:
        raise ValueError(f"No strategies given: use e.g. {SPEC_HELP}.")
    return out
