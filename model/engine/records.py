"""The records of decoding: one :class:`PassRecord` per forward pass (with a :class:`DraftCheck` when verifying) and
the :class:`GenerationResult` that sums them (paper 3.4, 4.5). The app, the evaluation, the benchmark and the lm-eval
model read these records only and never reach into the model (:mod:`model.engine.decoding` writes them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from .sampling import GREEDY

#: Every ``PassRecord.block_end``: why a pass kept no more tokens (its docstring says what each means).
BLOCK_ENDS = ("k_max", "below tau", "utf-8", "draft rejected", "stop token", "stop string", "max_new_tokens")


@dataclass(frozen=True)
class DraftCheck:
    """What verification did with the drafts and mask blocks of one pass (:attr:`PassRecord.verification`; the
    ``verify`` strategy only).

    Attributes:
        drafts: the draft ids fed, in order (``PassRecord.fed_drafts`` of them).
        draft_texts: each draft decoded on its own.
        checks: the model's greedy token at each draft's place (``len(drafts)`` ids; when sampling: the token it
            chose there: the draft if accepted, the replacement at the first rejected one, the most likely token
            after it).
        confidences: the model's top-1 probability at each draft's place (when sampling: the probability of
            ``checks`` under the model's sampling distribution).
        accepted: leading drafts equal to ``checks``.
        correction: the model's token in place of the first rejected draft (None if none rejected).
        correction_text: that token decoded on its own ("" when none).
        mask_blocks: the numbers of accepted drafts that a block of ``k_max - 1`` masks followed in this pass
            (``[len(drafts)]`` for the linear layout).
        block_proposals, block_texts, block_confidences: the proposals of each mask block (in the order of
            ``mask_blocks``), their texts and confidences.
        next_drafts: the drafts the next pass feeds: the proposals of the block that followed the accepted prefix,
            or none (no such block, or the answer ended).
    """

    drafts: list[int] = field(default_factory=list)
    draft_texts: list[str] = field(default_factory=list)
    checks: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    accepted: int = 0
    correction: int | None = None
    correction_text: str = ""
    mask_blocks: list[int] = field(default_factory=list)
    block_proposals: list[list[int]] = field(default_factory=list)
    block_texts: list[list[str]] = field(default_factory=list)
    block_confidences: list[list[float]] = field(default_factory=list)
    next_drafts: list[int] = field(default_factory=list)


@dataclass
class PassRecord:
    """What one forward pass did (the record the app, evaluation and benchmarks consume).

    Attributes:
        index: 0-based number of the forward pass (pass 0 is the prefill).
        fed_real: pending real tokens fed (the prompt on pass 0, its chunks fed before included, less any
            prefix reused from an earlier generation's KV cache; then the previous pass's last token(s) not yet in
            the KV cache).
        fed_drafts: draft tokens fed as real tokens (verification only, ``verification.drafts``; else 0).
        fed_masks: mask tokens fed (``k_max - 1``; 0 for standard decoding).
        proposals: ``k_max`` greedy token ids: at the last real token fed, then one per mask (when
            sampling: the tokens drawn there).
        proposal_texts: each proposal decoded on its own.
        confidences: ``k_max`` top-1 probabilities (float32 softmax over the vocabulary, the mask
            token excluded), one per proposal (when sampling: each drawn token's probability under its
            position's sampling distribution, what ConfAdapt compares with tau).
        kept: token ids this pass emitted (after UTF-8, stop-token and max_new_tokens trimming).
        text: the text this pass added to the answer (an incomplete last character is held back).
        accepted: tokens the strategy accepted before stop-token / max_new_tokens trimming.
        seconds: wall-clock seconds of the pass (forward, proposals, cache crop; device synchronised).
        stopped: True if this pass emitted a stop token.
        block_end: why the block ended: ``"k_max"`` (every proposal kept), ``"below tau"``,
            ``"utf-8"`` (the next proposal could not continue an open character), ``"draft
            rejected"``, ``"stop token"``, ``"stop string"`` or ``"max_new_tokens"``.
        verification: what verification did with this pass's drafts and mask blocks (:class:`DraftCheck`; None
            for the block strategies: standard, static k, ConfAdapt).
        shared_sequences: sequences whose rows shared this forward pass (1: it ran alone; more: a batch runner,
            :mod:`model.engine.batch`, carried other generations' rows in the same pass).
        shared_rows: rows of the whole shared pass (``fed_tokens`` when it ran alone).
    """

    index: int
    fed_real: int
    fed_masks: int
    proposals: list[int]
    proposal_texts: list[str]
    confidences: list[float]
    kept: list[int]
    text: str
    accepted: int
    seconds: float
    stopped: bool = False
    block_end: str = "k_max"
    fed_drafts: int = 0
    verification: DraftCheck | None = None
    shared_sequences: int = 1
    shared_rows: int = 0

    @property
    def counted_drafts(self) -> tuple[int, int]:
        """``(proposed, accepted)`` drafts of this pass that count in acceptance metrics: none after a stop
        token or ``max_new_tokens`` (a draft past the end of the answer was never needed)."""
        if not self.fed_drafts:
            return 0, 0
        accepted = min(self.verification.accepted if self.verification else 0, len(self.kept))
        ended = self.stopped or self.block_end == "max_new_tokens"
        proposed = min(self.fed_drafts, len(self.kept)) if ended else self.fed_drafts
        return proposed, min(accepted, proposed)

    @property
    def fed_tokens(self) -> int:
        """All tokens fed to this forward pass (pending + drafts + masks)."""
        return self.fed_real + self.fed_drafts + self.fed_masks

    def to_dict(self) -> dict:
        """JSON-ready dict (includes ``fed_tokens``)."""
        d = asdict(self)
        d["fed_tokens"] = self.fed_tokens
        return d


@dataclass
class GenerationResult:
    """Totals of one generation.

    Attributes:
        text: the answer (special tokens skipped, no incomplete last character).
        token_ids: the generated ids (the stop token included if one was emitted).
        passes: one :class:`PassRecord` per forward pass.
        strategy: the strategy's spec string.
        sampling: the sampling settings (:class:`~model.engine.sampling.Sampling`; the seed actually used when
            sampling).
    """

    text: str
    token_ids: list[int]
    passes: list[PassRecord] = field(default_factory=list)
    strategy: str = "standard"
    sampling: dict = field(default_factory=GREEDY.to_dict)

    @property
    def new_tokens(self) -> int:
        """Tokens generated."""
        return len(self.token_ids)

    @property
    def forward_passes(self) -> int:
        """Forward passes run (prefill included)."""
        return len(self.passes)

    @property
    def effective_k(self) -> float:
        """Tokens per forward pass (the paper's acceleration measure)."""
        return self.new_tokens / self.forward_passes if self.passes else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per forward pass, the model's own token included (vLLM / llama.cpp's "mean acceptance
        length"; the paper's effective k)."""
        return self.effective_k

    @property
    def drafts_proposed(self) -> int:
        """Drafts fed for checking (verification), none counted past the end of the answer."""
        return sum(p.counted_drafts[0] for p in self.passes)

    @property
    def drafts_accepted(self) -> int:
        """Drafts accepted (verification), none counted past the end of the answer."""
        return sum(p.counted_drafts[1] for p in self.passes)

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts (None without drafts)."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else None

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """Per draft position j = 1, 2, ...: the share of passes that fed a draft at j in which it was
        accepted (vLLM's per-position acceptance rate; a draft after a rejected one counts as rejected)."""
        return acceptance_by_position(self.passes)

    @property
    def drafts_by_position(self) -> tuple[list[int], list[int]]:
        """Per draft position j = 1, 2, ...: ``(accepted, proposed)``, the counts behind
        :attr:`acceptance_by_position` (a share of 0.00 over 2 drafts says little)."""
        tally = DraftTally(self.passes)
        return tally.accepted, tally.proposed

    @property
    def seconds(self) -> float:
        """Sum of the passes' own seconds."""
        return sum(p.seconds for p in self.passes)

    @property
    def tokens_per_second(self) -> float:
        """new_tokens / seconds (0 before any pass)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        """The CLI's ``--json`` object (strict JSON: no NaN)."""
        return {
            "strategy": self.strategy, "text": self.text, "new_tokens": self.new_tokens,
            "forward_passes": self.forward_passes, "effective_k": self.effective_k,
            "mean_acceptance_length": self.mean_acceptance_length, "drafts_proposed": self.drafts_proposed,
            "drafts_accepted": self.drafts_accepted, "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position, "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second, "sampling": self.sampling,
            "passes": [p.to_dict() for p in self.passes],
        }


class DraftTally:
    """Drafts proposed and accepted by draft position, pass by pass (:attr:`PassRecord.counted_drafts`): what
    :func:`acceptance_by_position` reports, kept up to date as passes are added (a decoder asks for it before
    every ``verify:auto`` pass: counting from the first pass each time grew with the answer).

    Attributes:
        proposed / accepted: per draft position j = 1, 2, ...: passes that proposed draft j / that accepted it.
        passes_with_drafts: passes that proposed at least one draft.
    """

    def __init__(self, passes: Sequence[PassRecord] = ()):
        self.proposed: list[int] = []
        self.accepted: list[int] = []
        self.passes_with_drafts = 0
        for p in passes:
            self.add(p)

    def add(self, p: PassRecord) -> None:
        """Count one pass's drafts."""
        self.add_counts(*p.counted_drafts)

    def add_counts(self, n: int, a: int) -> None:
        """Count one pass that proposed ``n`` drafts and accepted the first ``a`` (a report's ``drafts_per_pass``)."""
        while len(self.proposed) < n:
            self.proposed.append(0)
            self.accepted.append(0)
        for j in range(n):
            self.proposed[j] += 1
            self.accepted[j] += int(j < a)
        self.passes_with_drafts += int(n > 0)

    def by_position(self) -> list[float | None]:
        """Accepted / proposed per draft position, None where no draft was proposed."""
        return [a / n if n else None for a, n in zip(self.accepted, self.proposed)]


#: Draft positions checked fewer times than this are shown as counts (``0 of 2``) by :func:`by_position_text`.
FEW_CHECKS = 10


def by_position_text(accepted: Sequence[int], checked: Sequence[int]) -> str:
    """Acceptance by draft position for people, e.g. ``0.79 / 0 of 2``: each position's share of the passes that
    checked a draft there, or its counts where those passes are fewer than :data:`FEW_CHECKS` (a verify:auto
    answer that mostly feeds one draft may feed two twice: a share of 0.00 there read like a measured rate)."""
    return " / ".join(f"{a / n:.2f}" if n >= FEW_CHECKS else f"{a} of {n}" for a, n in zip(accepted, checked))


def acceptance_by_position(passes: Sequence[PassRecord]) -> list[float | None]:
    """Per draft position j = 1, 2, ...: accepted / proposed over ``passes`` (:attr:`PassRecord.counted_drafts`:
    nothing past the end of an answer), None where no draft was proposed."""
    return DraftTally(passes).by_position()
