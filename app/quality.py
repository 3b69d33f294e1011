"""How good each answer of a turn is, beside how fast: its likelihood under the teacher (the base model, adapter
off) and whether it degenerates into repetition (paper 4.5), and a finished answer as a point of the page's
speed / quality trade-off figure.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from model.engine.decoding import GenerationResult
from model.engine.scoring import teacher_nll
from model.evaluation.sweep import AnswerPoint

from .passes import exclusive

if TYPE_CHECKING:
    from .turn import Turn, TurnState

log = logging.getLogger(__name__)

#: Repetition: the answer's last :data:`LOOP_SPAN` tokens or more repeat an n-gram of at most
#: :data:`LOOP_MAX_PERIOD` tokens, or its last :data:`DISTINCT_WINDOW` tokens hold fewer than
#: :data:`DISTINCT_FLOOR` distinct tokens per token.
LOOP_SPAN = 24
LOOP_MAX_PERIOD = 32  # a sentence looped ("The rope is like a rope with a rope attached to it.": 14 tokens)
DISTINCT_WINDOW = 48
DISTINCT_FLOOR = 0.2


def repeats(token_ids: Sequence[int]) -> bool:
    """True when an answer degenerates into repetition: :data:`LOOP_SPAN` tokens (at least three periods) ending
    less than one period before its end (a stutter out of the loop, cut by max new tokens, still counts) are one
    n-gram of at most :data:`LOOP_MAX_PERIOD` tokens repeated, or its last
    :data:`DISTINCT_WINDOW` tokens have a distinct-token ratio under :data:`DISTINCT_FLOOR`."""
    ids = list(token_ids)
    for period in range(1, LOOP_MAX_PERIOD + 1):
        span = max(LOOP_SPAN, 3 * period)
        for end in range(len(ids), max(len(ids) - period, span - 1), -1):  # the loop may end a stutter early
            if all(ids[end - j] == ids[end - j - period] for j in range(1, span - period + 1)):
                return True
    tail = ids[-DISTINCT_WINDOW:]
    return len(tail) >= DISTINCT_WINDOW and len(set(tail)) / len(tail) < DISTINCT_FLOOR


@dataclass(frozen=True)
class Quality:
    """Each answer's quality under the teacher (the base model, adapter off), scored once both sides are
    done or stopped, outside the timed passes.

    Attributes:
        standard_nll, mtp_nll: mean negative log-likelihood per token (nats) of each answer after the prompt
            (None for an empty answer, or when scoring failed).
        standard_repeats, mtp_repeats: the answer degenerates into repetition (:func:`repeats`).
    """

    standard_nll: float | None
    mtp_nll: float | None
    standard_repeats: bool = False
    mtp_repeats: bool = False

    @property
    def gap(self) -> float | None:
        """``mtp_nll - standard_nll`` (> 0: the MTP answer is less likely under the model)."""
        if self.standard_nll is None or self.mtp_nll is None:
            return None
        return self.mtp_nll - self.standard_nll


def score_answers(turn: "Turn", std: GenerationResult, mtp: GenerationResult,
                  lock: threading.Lock | None = None) -> Quality:
    """One scoring pass per answer (:func:`model.engine.scoring.teacher_nll`, adapter off) under ``lock``;
    a failure leaves that NLL None (logged), never an error in the page. Where the standard side ran the
    teacher's weights on every token (no adapter, or aLoRA), its KV cache holds the teacher's prompt: each
    pass then feeds the answer only, not the whole conversation again."""
    lock = lock if lock is not None else exclusive()
    std_side = turn.sides["standard"]
    prompt_cache = (std_side.cache, std_side.cached_ids) if turn.lm.real_tokens_run_base else None

    def nll(res: GenerationResult) -> float | None:
        if not res.token_ids:
            return None
        try:
            with lock:
                total, n = teacher_nll(turn.lm, turn.prompt_ids, res.token_ids, context_cache=prompt_cache)
        except Exception:  # noqa: BLE001 - quality is extra: the turn still ends cleanly
            log.exception("scoring an answer failed")
            return None
        return total / n if n else None
    return Quality(nll(std), nll(mtp), repeats(std.token_ids), repeats(mtp.token_ids))


def answer_point(state: "TurnState") -> AnswerPoint | None:
    """A finished turn as a point of the trade-off figure (:class:`model.evaluation.sweep.AnswerPoint`: plain
    data, it pickles out of a ZeroGPU worker). None unless the turn is done and both answers were scored."""
    q = state.quality
    if state.phase != "done" or q is None or q.mtp_nll is None:
        return None
    s = state.strategy
    return AnswerPoint(tuple(state.turn.model_key), state.turn.number, s.label, s.name, s.tau, state.mtp.effective_k,
                       state.identical, state.parted_at, q.mtp_nll, q.standard_nll, q.mtp_repeats,
                       not state.turn.sampling.greedy)
