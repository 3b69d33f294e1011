"""Decoding strategies: which of a forward pass's proposals become output (paper 3.4, 4.5).

The one vocabulary of strategies that the CLI, the app, the evaluation, the benchmark and the
lm-eval model share: their names, parameters, defaults, caps, labels and spec strings are written
here once, and :func:`resolve_strategy` is the one way from user input to a strategy.

=============  ===========================  =======================================================
spec           class                        a forward pass keeps
=============  ===========================  =======================================================
``standard``   :class:`Standard`            one token, no mask tokens fed (the baseline)
``static:K``   :class:`StaticK`             the first ``K`` proposals (``k_max = K``)
``confadapt:   :class:`ConfAdapt`           the longest leading run of proposals whose confidence
TAU[:K_MAX]``                               is ≥ tau, always at least the first
``verify       :class:`Verify`              the drafts fed from the previous pass that equal the
[:K_MAX                                     model's own greedy choice, plus its next token
[:LAYOUT]]``                                (lossless: output == standard decoding); LAYOUT says
                                            which draft prefixes a block of masks follows
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
    next token (see :mod:`model.engine.decoding`). Output == standard decoding of the same model.

    ``blocks`` says where a pass that feeds drafts puts its blocks of ``k_max - 1`` mask tokens: after
    the pending token and the first ``a`` drafts, for each ``a`` in ``blocks``. Whichever prefix of the
    drafts the pass accepts, if a block followed that prefix, its proposals are the next pass's drafts;
    otherwise the next pass has none. ``None`` (the linear layout) is one block after all drafts;
    :data:`FULL` is a block after every prefix ("quadratic" decoding, arXiv 2507.11851).
    """

    name: ClassVar[str] = "verify"
    verifies: ClassVar[bool] = True
    k_max: int = DEFAULT_K_MAX
    blocks: tuple[int, ...] | None = None
    auto: bool = False

    def __post_init__(self) -> None:
        if self.auto and self.blocks is not None:
            raise ValueError("verify:auto chooses its layout pass by pass: give no mask blocks with it.")
        if self.blocks is not None:
            if not self.blocks or any(not 0 <= a < self.k_max for a in self.blocks):
                raise ValueError(f"Mask blocks sit after 0 to {self.k_max - 1} drafts (k_max - 1), got "
                                 f"{'/'.join(map(str, self.blocks)) or 'none'}.")
            object.__setattr__(self, "blocks", tuple(sorted(set(self.blocks))))
            if self.blocks == (self.k_max - 1,):
                object.__setattr__(self, "blocks", None)  # the linear layout, one spelling

    @property
    def lookahead(self) -> int:
        """KV-cache entries a pass may hold past the tokens already emitted: ``k_max - 1`` drafts and a
        block of ``k_max - 1`` masks per block (a windowed model must hold them all within its window)."""
        if self.auto:  # any layout up to a block after every prefix
            return self.num_masks * (1 + self.k_max)
        return self.num_masks * (1 + (1 if self.blocks is None else len(self.blocks)))

    def mask_blocks(self, drafts: int) -> tuple[int, ...]:
        """The prefixes (numbers of accepted drafts) followed by a mask block in a pass that feeds
        ``drafts`` drafts: ``(0,)`` without drafts (the masks follow the pending token)."""
        if drafts == 0:
            return (0,)
        if self.blocks is None:
            return (drafts,)
        return tuple(a for a in self.blocks if a <= drafts)

    def accept(self, confidences: Sequence[float]) -> tuple[int, str]:  # noqa: D102
        return 1, "k_max"  # the block of a verify pass is decided by the drafts, not by confidence

    def at(self, k_max: int, blocks: tuple[int, ...] | None) -> "Verify":
        """The fixed layout this strategy runs for one pass (``verify:auto`` chooses it pass by pass)."""
        return Verify(k_max=k_max, blocks=blocks)

    @property
    def layout(self) -> str:
        """``linear``, ``full``, ``auto`` or the prefixes followed by a block, e.g. ``0/1/3``."""
        if self.auto:
            return "auto"
        if self.blocks is None:
            return "linear"
        if self.blocks == tuple(range(self.k_max)):
            return "full"
        return "/".join(map(str, self.blocks))

    @property
    def label(self) -> str:  # noqa: D102
        if self.auto:
            return f"lossless verify, k_max ≤ {self.k_max} and layout chosen per pass"
        tail = "" if self.blocks is None else (", full tree" if self.layout == "full" else
                                               f", mask blocks after {self.layout} drafts")
        return f"lossless verify k_max={self.k_max}{tail}"

    @property
    def spec(self) -> str:  # noqa: D102
        return f"verify:{self.k_max}" if self.blocks is None and not self.auto else f"verify:{self.k_max}:{self.layout}"


def verify_layout(k_max: int, layout: Any) -> tuple[int, ...] | None:
    """``Verify.blocks`` from a layout name: ``linear`` (None), ``full``, or prefixes such as ``0/1/3``.

    Raises:
        ValueError: a malformed layout.
    """
    text = str(layout or "linear").strip().lower()
    if text == "linear":
        return None
    if text == "auto":
        raise ValueError("verify:auto is a strategy of its own (Verify(auto=True)), not a fixed layout.")
    if text == "full":
        return tuple(range(k_max))
    try:
        return tuple(int(x) for x in text.split("/") if x.strip())
    except ValueError:
        raise ValueError(f"A verify layout is linear, full or prefixes such as 0/1/3, got {layout!r}.") from None


STRATEGY_NAMES = ("standard", "static", "confadapt", "verify")
SPEC_HELP = ("standard, static:K, confadapt:TAU[:K_MAX] or verify[:K_MAX[:LAYOUT]] (LAYOUT: linear, full, 0/1/3, or "
             "auto: chosen per pass from the width cost and the load; verify:auto[:K_MAX])")


def standard() -> Standard:
    """Next-token prediction, one token per forward pass (the baseline)."""
    return Standard()


def static_k(k: Any = DEFAULT_STATIC_K) -> StaticK:
    """Static k (paper 4.5): keep the first ``k`` proposals of every pass.

    Raises:
        ValueError: ``k`` not in 1 .. :data:`MAX_K_MAX`.
    """
    return StaticK(k=parse_whole_number(k, "k", 1, MAX_K_MAX))


def confadapt(tau: Any = DEFAULT_TAU, k_max: Any = DEFAULT_K_MAX) -> ConfAdapt:
    """ConfAdapt with threshold ``tau`` and ``k_max`` proposals per pass (paper 4.5).

    Raises:
        ValueError: tau outside [0, 1]; k_max not in 1 .. :data:`MAX_K_MAX`.
    """
    return ConfAdapt(tau=parse_tau(tau), k_max=check_k_max(k_max))


def verify(k_max: Any = DEFAULT_K_MAX, layout: Any = "linear") -> Verify:
    """Lossless verification of mask drafts, ``k_max - 1`` drafts at most per pass, with mask blocks
    laid out as ``layout`` says (:func:`verify_layout`).

    Raises:
        ValueError: k_max not in 1 .. :data:`MAX_K_MAX`, or a bad layout.
    """
    k = check_k_max(k_max)
    if str(layout or "").strip().lower() == "auto":
        return Verify(k_max=k, auto=True)
    return Verify(k_max=k, blocks=verify_layout(k, layout))


def _k_max_in(value: Any, cap: int) -> int:
    return parse_whole_number(value, "k_max", 1, cap)


def resolve_strategy(
    choice: Any,
    *,
    tau: Any = None,
    k_max: Any = None,
    k: Any = None,
    layout: Any = None,
    default_k_max: int = DEFAULT_K_MAX,
    cap: int = MAX_K_MAX,
) -> Strategy:
    """The one way from what a user gave to a :class:`Strategy` (CLIs, the app, evaluation, bench, lm-eval).

    Args:
        choice: a name (``standard``, ``static``, ``confadapt``, ``verify``; case and spaces ignored)
            whose parameters come from the keyword arguments, or a spec (``static:K``,
            ``confadapt:TAU[:K_MAX]``, ``verify[:K_MAX]``) whose own values win over them.
        tau: ConfAdapt's threshold; None: :data:`DEFAULT_TAU`.
        k_max: proposals per pass; None: ``default_k_max``. For static k, when given, an upper bound
            that ``k`` must respect.
        k: static k's block size; None: :data:`DEFAULT_STATIC_K`.
        layout: verify's mask blocks (:func:`verify_layout`); None: linear.
        default_k_max: the model's k_max (:attr:`LoadedModel.default_k_max`, or
            :func:`~model.engine.loading.trained_k_max` before loading), used when no k_max is given;
            at most ``cap``.
        cap: the caller's largest k_max and static k (the engine's :data:`MAX_K_MAX`, the app's own).

    Raises:
        ValueError: an unknown name, a malformed spec or an out-of-range parameter, naming it.
    """
    head, *args = str(choice or "").strip().lower().replace(" ", "").split(":")
    if head not in STRATEGY_NAMES or (head == "standard" and args) or len(args) > (1 if head == "static" else 2):
        raise ValueError(f"Unknown strategy {choice!r}: use {SPEC_HELP}.")
    try:
        if head == "standard":
            return standard()
        if head == "static":
            size = parse_whole_number(args[0] if args else (DEFAULT_STATIC_K if k is None else k), "k", 1, cap)
            if k_max is not None and not args and size > _k_max_in(k_max, cap):
                raise ValueError(f"k ({size}) cannot exceed k_max ({k_max}).")
            return StaticK(k=size)
        if head == "confadapt":
            t = parse_tau(args[0] if args else (DEFAULT_TAU if tau is None else tau))
            km = args[1] if len(args) > 1 else (min(default_k_max, cap) if k_max is None else k_max)
            return ConfAdapt(tau=t, k_max=_k_max_in(km, cap))
        auto = "auto" in args or (len(args) < 2 and str(layout or "").strip().lower() == "auto")
        rest = [a for a in args if a != "auto"]  # verify:auto[:K_MAX] or verify:K_MAX:auto
        km = _k_max_in(rest[0] if rest else (min(default_k_max, cap) if k_max is None else k_max), cap)
        if auto:
            return Verify(k_max=km, auto=True)
        return Verify(k_max=km, blocks=verify_layout(km, args[1] if len(args) > 1 else layout))
    except ValueError as e:
        raise ValueError(f"Bad strategy {choice!r}: {e}" if args else str(e)) from None


def parse_strategies(specs: str | Sequence[str | Strategy], default_k_max: int = DEFAULT_K_MAX,
                     cap: int = MAX_K_MAX) -> list[Strategy]:
    """A comma-separated list (or a list) of names or specs, each through :func:`resolve_strategy`
    (strategies in the list are kept as they are); duplicates are dropped, order kept.

    Raises:
        ValueError: an empty list or a bad entry.
    """
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    out: list[Strategy] = []
    for s in items:
        if isinstance(s, Strategy) or s.strip():
            st = s if isinstance(s, Strategy) else resolve_strategy(s, default_k_max=default_k_max, cap=cap)
            if st not in out:
                out.append(st)
    if not out:
        raise ValueError(f"No strategies given: use e.g. {SPEC_HELP}.")
    return out
