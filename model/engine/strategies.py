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

A strategy owns its behaviour in a pass: where its mask blocks go (:meth:`Strategy.mask_blocks`), what it accepts
greedily and when sampling (:meth:`Strategy.accept_pass`, :meth:`Strategy.accept_pass_sampled`, with the rules of
:mod:`model.engine.acceptance`), what stays in the KV cache and pending afterwards (:meth:`Strategy.cached_after`,
:meth:`Strategy.pending_after`), and what its pass record says of drafts and mask blocks (:meth:`Strategy.draft_check`).
Parsing specs is :mod:`model.engine.strategy_specs` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from .acceptance import Acceptance, accept_block, accept_block_sampled, accept_verified, accept_verified_sampled
from .records import DraftCheck

DEFAULT_K_MAX = 16  # proposals per forward pass when nothing else says (the paper's sweep uses 16)
MAX_K_MAX = 64  # the largest k_max accepted anywhere (engine, CLI, app)
DEFAULT_TAU = 0.9  # ConfAdapt's default threshold (the paper's headline operating point)
DEFAULT_STATIC_K = 3  # static k's default block size (the paper's best static k on GSM8K)


# ----------------------------------------------------------------------------- strategies
class Strategy:
    """Base of the strategies. Subclasses are frozen dataclasses; compare and hash by value.

    Class attributes:
        name: the spec keyword (``standard``, ``static``, ``confadapt``, ``verify``).
        lossless: True when the output equals standard decoding's by construction (verification of drafts).

    Attributes:
        k_max: proposals per forward pass; a pass feeds ``k_max - 1`` mask tokens.
        tau: ConfAdapt's threshold (None for the others).
        k: static k's block size (None for the others).
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    k_max: int
    tau: float | None = None
    k: int | None = None

    @property
    def num_masks(self) -> int:
        """Mask tokens appended to each forward pass: ``k_max - 1``."""
        return self.k_max - 1

    @property
    def lookahead(self) -> int:
        """Positions a pass may use past the tokens already emitted (its masks)."""
        return self.num_masks

    def mask_blocks(self, drafts: int) -> tuple[int, ...]:
        """The draft prefixes followed by a block of masks in a pass that feeds ``drafts`` drafts: a block strategy
        feeds no drafts and one block right after the pending tokens, ``(0,)``."""
        return (0,)

    def accept_pass(self, lm: Any, generated: Sequence[int], layout: Any, greedy: Sequence[int],
                    conf: Sequence[float], drafts: Sequence[int]) -> Acceptance:
        """The accept phase of a greedy pass (:mod:`model.engine.acceptance`): the leading run :meth:`accept` keeps.

        Args:
            lm: the model (its tokens' bytes: a block never ends inside a character).
            generated: tokens emitted before this pass.
            layout: the pass's :class:`~model.engine.phases.PassLayout`; ``drafts``: the drafts it fed.
            greedy, conf: greedy ids and confidences at the last pending token, each draft and each mask.
        """
        return accept_block(lm, self.accept, generated, greedy, conf)

    def accept_pass_sampled(self, lm: Any, generated: Sequence[int], layout: Any, probs: Any, model_probs: Any,
                            drafts: Sequence[int], draft_probs: Any, sampler: Any
                            ) -> tuple[list[int], list[float], Acceptance]:
        """The accept phase when sampling: tokens drawn from ``probs`` (``[logits_to_keep, V]``), judged by their
        probabilities under ``model_probs`` (:func:`~model.engine.acceptance.accept_block_sampled`). Returns
        ``(tokens, probabilities, acceptance)``."""
        return accept_block_sampled(lm, self.accept, generated, probs, model_probs, sampler)

    def cached_after(self, kept: Sequence[int]) -> list[int]:
        """The kept tokens whose KV entries this pass already wrote and that stay (the commit keeps them): none for
        a block strategy (its masks' entries are dropped)."""
        return []

    def pending_after(self, kept: Sequence[int]) -> list[int]:
        """The tokens the next pass feeds first (not yet in the KV cache): every kept token of a block strategy."""
        return list(kept)

    def draft_check(self, layout: Any, drafts: Sequence[int], greedy: Sequence[int], conf: Sequence[float],
                    acc: Acceptance, blocks: list, block_conf: list, next_drafts: Sequence[int], decode: Any
                    ) -> DraftCheck | None:
        """The record's :attr:`~model.engine.records.PassRecord.verification`: what the pass did with its drafts and
        mask blocks. None for a block strategy: it feeds no drafts, and its one block is already its record's
        proposals.

        Args:
            layout: the pass's :class:`~model.engine.phases.PassLayout`; ``drafts``: the drafts it fed.
            greedy, conf: the model's ids and confidences at the last pending token, each draft and each mask.
            acc: the pass's :class:`~model.engine.acceptance.Acceptance`.
            blocks, block_conf: each mask block's proposals and confidences, in the order of ``layout.blocks``.
            next_drafts: the drafts the next pass feeds; ``decode``: ids -> text.
        """
        return None

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
    """ConfAdapt (paper 4.5): keep the longest leading run of proposals with confidence ≥ tau, counted from the
    first proposal (the model's next token), and at least that one. A first proposal under tau keeps the pass to
    one token however sure the masks are: they guessed past a token the model itself was unsure of (the paper's
    "greatest k' such that every position up to k' clears tau", as the authors' SGLang code applies it)."""

    name: ClassVar[str] = "confadapt"
    tau: float = DEFAULT_TAU  # type: ignore[assignment]
    k_max: int = DEFAULT_K_MAX

    def accept(self, confidences: Sequence[float]) -> tuple[int, str]:  # noqa: D102
        n = 0
        while n < len(confidences) and confidences[n] >= self.tau:
            n += 1
        n = max(n, 1)
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
    lossless: ClassVar[bool] = True
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

    def accept_pass(self, lm: Any, generated: Sequence[int], layout: Any, greedy: Sequence[int],
                    conf: Sequence[float], drafts: Sequence[int]) -> Acceptance:
        """The drafts equal to the model's own choice, then its next token
        (:func:`~model.engine.acceptance.accept_verified`); the rest as :meth:`Strategy.accept_pass`."""
        return accept_verified(layout, greedy, drafts)

    def accept_pass_sampled(self, lm: Any, generated: Sequence[int], layout: Any, probs: Any, model_probs: Any,
                            drafts: Sequence[int], draft_probs: Any, sampler: Any
                            ) -> tuple[list[int], list[float], Acceptance]:
        """Speculative sampling of the drafts (:func:`~model.engine.acceptance.accept_verified_sampled`)."""
        return accept_verified_sampled(layout, probs, model_probs, drafts, draft_probs, sampler)

    def cached_after(self, kept: Sequence[int]) -> list[int]:
        """The accepted drafts: every kept token but the last (their entries, written as drafts, are right)."""
        return list(kept[:-1])

    def pending_after(self, kept: Sequence[int]) -> list[int]:
        """The last kept token only (the model's own, never fed yet)."""
        return list(kept[-1:])

    def draft_check(self, layout: Any, drafts: Sequence[int], greedy: Sequence[int], conf: Sequence[float],
                    acc: Acceptance, blocks: list, block_conf: list, next_drafts: Sequence[int], decode: Any
                    ) -> DraftCheck:
        """The drafts, the model's choice and confidence at each draft's place, the acceptance and correction, and
        every block's prefix, proposals, texts and confidences (the app draws the tree from them)."""
        d = layout.drafts
        return DraftCheck(
            drafts=list(drafts), draft_texts=[decode([t]) for t in drafts], checks=list(greedy[:d]),
            confidences=list(conf[:d]), accepted=acc.drafts_accepted, correction=acc.correction,
            correction_text=decode([acc.correction]) if acc.correction is not None else "",
            mask_blocks=list(layout.blocks), block_proposals=blocks,
            block_texts=[[decode([t]) for t in b] for b in blocks], block_confidences=block_conf,
            next_drafts=list(next_drafts),
        )

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


from .strategy_specs import (SPEC_HELP, STRATEGY_NAMES, check_k_max, check_max_new_tokens, confadapt,  # noqa: E402,F401
                             parse_strategies, parse_tau, parse_whole_number, resolve_strategy, standard, static_k,
                             verify, verify_layout)
