"""Strategy specs: from what a user gives (a name and parameters, or a spec string such as ``confadapt:0.9:4``) to a
:class:`~model.engine.strategies.Strategy`, and the checks of each parameter (paper 4.5).

:func:`resolve_strategy` is the one way from user input to a strategy (the CLIs, the app, evaluation, bench and
lm-eval call it); :mod:`model.engine.strategies` re-exports everything here.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .strategies import (DEFAULT_K_MAX, DEFAULT_STATIC_K, DEFAULT_TAU, MAX_K_MAX, ConfAdapt, Standard, StaticK,
                         Strategy, Verify)


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
    except ValueError as e:  # the reason continues the sentence ("...: a verify layout is ...")
        why = str(e)
        first = why.split(" ", 1)[0]
        why = why[:1].lower() + why[1:] if first[:1].isupper() and first[1:] == first[1:].lower() else why
        raise ValueError(f"Bad strategy {choice!r}: {why}" if args else why) from None


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
