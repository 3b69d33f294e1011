"""One chat turn: standard decoding against an MTP strategy on the same prompt, without any Gradio type
(paper 3.4, 4.5).

* :func:`prepare_turn` checks a :class:`~app.requests.TurnRequest` with the engine's own vocabulary plus the
  app's limits (:mod:`app.requests`), finds the model, builds the messages and the prompt ids, and checks the
  context budget: a :class:`Turn`, or a :class:`~model.errors.RequestError` with a message meant for the page.
* :func:`run_turn` runs it: one forward pass of each side in turn (through :mod:`app.passes`, which may share a
  pass with other sessions), yielding a :class:`TurnState` (the engine's plain records) after every pass and a
  last state that says how the turn ended (done, stopped, cleared, error).

Like with like: both sides answer the same prompt ids. From turn 2 on the conversation's earlier answers are
the standard side's (the reference); the MTP side's own earlier answers are shown, not fed back. No model code
lives here: this module calls the engine (``model.*``) and keeps its records.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from model.engine.decoding import PREFILL_CHUNK, Decoder, GenerationResult
from model.engine.loaded_model import LoadedModel
from model.engine.loading import DEFAULT_SOURCE
from model.engine.sampling import GREEDY, Sampling
from model.engine.strategies import Strategy, Verify, standard, verify_layout
from model.errors import NonFiniteLogitsError, RequestError

from .device import LosslessShape
from .passes import SHARED, PassScheduler
from .quality import Quality, score_answers
from .requests import (
    MAX_PROMPT_TOKENS,
    TurnRequest,
    app_max_new_tokens,
    app_sampling,
    app_strategy,
    check_message,
    check_shape,
    parse_history,
)
from .timing import SpeedEstimate, estimate_speedup

if TYPE_CHECKING:
    from .prefixes import PrefixStore
    from .registry import ModelRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Turn:
    """A validated request: what :func:`run_turn` needs.

    Attributes:
        lm: the model.
        strategy: the right pane's MTP strategy (the left pane is always standard decoding).
        max_new_tokens: per side.
        history: the conversation before this turn (:func:`parse_history`'s form).
        message: the user's message.
        prompt_ids: the prompt both sides answer (history with the standard answers + message).
        number: 1-based turn number.
        model_key: ``(source, quantization, precision)`` of ``lm``.
        sides: the two decoders, ``{"standard": ..., "mtp": ...}``, made (and so checked against the
            model's context) when the turn is prepared; :func:`run_turn` runs them.
        shape: for lossless turns whose shape was chosen for this device, the choice
            (:class:`app.device.LosslessShape`); else None.
        sampling: both sides' sampling settings (greedy at temperature 0; the seed both sides draw from).
    """

    lm: LoadedModel
    strategy: Strategy
    max_new_tokens: int
    history: list[dict]
    message: str
    prompt_ids: list[int]
    number: int
    model_key: tuple[str, str, str] = (DEFAULT_SOURCE, "none", "auto")
    sides: dict = field(default_factory=dict, compare=False, repr=False)
    shape: LosslessShape | None = None
    sampling: Sampling = GREEDY


def engine_messages(history: Sequence[dict]) -> list[dict]:
    """History messages as the engine reads them: ``{"role", "content"}`` (the standard answers)."""
    return [{"role": m["role"], "content": m["content"]} for m in history]


def lossless_strategy(strategy: Strategy, shape: str, registry: "ModelRegistry", key: tuple, lm: LoadedModel
                      ) -> tuple[Strategy, LosslessShape | None]:
    """The lossless strategy a turn runs: ``fastest here`` is ``verify:auto`` with the k_max box's value as its
    upper bound, choosing each pass's k_max and layout from this device's width cost (measured if not known yet,
    refreshed by the page's passes) and the rows other sessions put beside it (:class:`~model.engine.width.AutoWidth`);
    its :class:`~app.device.LosslessShape` is the choice for a pass alone (what the page shows). A fixed layout runs
    at the box's k_max. Other strategies pass through.

    Raises:
        RequestError: a layout that does not fit the k_max."""
    if not isinstance(strategy, Verify):
        return strategy, None
    if shape == "fastest here":
        chosen = registry.facts.shape(key, lm, strategy.k_max)
        if chosen is not None:
            return Verify(k_max=strategy.k_max, auto=True), chosen
        return strategy, None  # no width profile (the measurement failed): the linear layout, as set
    try:
        return Verify(k_max=strategy.k_max, blocks=verify_layout(strategy.k_max, shape)), None
    except ValueError as e:
        raise RequestError(str(e)) from None


def prepare_turn(registry: "ModelRegistry", request: TurnRequest, prefixes: "PrefixStore | None" = None) -> Turn:
    """Check one request and build its :class:`Turn` (loading the model if needed).

    Args:
        registry: where the model is found.
        request: what the page asked for (:class:`app.requests.TurnRequest`). Its k_max defaults to the model's
            (:func:`app.requests.app_k_max`); its lossless ``shape``: ``fastest here`` runs the shape chosen for
            this device with k_max at most the k_max given (:func:`lossless_strategy`); ``linear`` (default),
            ``full tree`` or prefixes such as ``0/1/3`` run that layout at the k_max given.
        prefixes: the sessions' KV caches (:class:`app.prefixes.PrefixStore`): both sides start from the longest
            prefix of the prompt that the session's last turn left in their caches.

    Raises:
        RequestError: with a message for the page (bad input, model not loadable, prompt too long
            for the app or for the model's positions).
    """
    text = check_message(request.message)
    hist = parse_history(request.history)
    key = registry.key(*request.key)
    n_new = app_max_new_tokens(request.max_new_tokens)
    sampling = app_sampling(request.temperature, request.top_p, request.seed)
    lm = registry.get(*key)
    strat, chosen = app_strategy(request.strategy, request.tau, request.k_max, request.k, lm.default_k_max), None
    if strat.lossless:  # the shape is checked only where it is used
        strat, chosen = lossless_strategy(strat, check_shape(request.shape), registry, key, lm)
    turn_messages = engine_messages(hist) + [{"role": "user", "content": text}]
    try:
        ids = lm.prompt_ids(turn_messages)
    except ValueError as e:
        raise RequestError(str(e)) from None
    if len(ids) > MAX_PROMPT_TOKENS:
        what, fix = (("This conversation", "Shorten the message or press Clear to start a new chat") if hist else
                     ("The message", "Shorten it and send again"))
        raise RequestError(f"{what} is {len(ids):,} tokens long; this demo prefills at most "
                           f"{MAX_PROMPT_TOKENS:,} tokens. {fix}.")
    reuse = prefixes.take(request.session, key, ids, ("standard", "mtp")) if prefixes is not None else {}
    try:  # the engine checks the context budget (the MTP side looks further ahead than standard)
        width = registry.facts.auto_width(key, lm) if getattr(strat, "auto", False) else None
        sides = {"standard": Decoder(lm, ids, standard(), n_new, sampling, prefix=reuse.get("standard")),
                 "mtp": Decoder(lm, ids, strat, n_new, sampling, prefix=reuse.get("mtp"), width=width)}
    except ValueError as e:
        raise RequestError(str(e)) from None
    number = sum(1 for m in hist if m["role"] == "user") + 1
    return Turn(lm=lm, strategy=strat, max_new_tokens=n_new, history=hist, message=text, prompt_ids=list(ids),
                number=number, model_key=key, sides=sides, shape=chosen, sampling=sampling)


#: How a turn ended (TurnState.phase once it is final).
PHASES = ("running", "done", "stopped", "cleared", "error")


@dataclass
class TurnState:
    """Where a turn stands after a forward pass (what :func:`run_turn` yields).

    Attributes:
        turn: the request.
        standard, mtp: each side's :class:`~model.engine.decoding.GenerationResult` so far (text, tokens,
            passes, effective k, seconds).
        standard_done, mtp_done: that side has finished (stop token or max_new_tokens).
        phase: ``running`` while passes remain, then ``done``, ``stopped`` (Stop), ``cleared``
            (Clear) or ``error``.
        error: the message when ``phase == "error"``.
        wall_seconds: since the turn started (both sides, passes alternating, and the scoring).
        last: which side ran the latest pass (``"standard"`` / ``"mtp"``), None before any.
        quality: each answer's :class:`Quality`, on the final state of a turn that ended done or
            stopped (None before, and after Clear or an error).
        prefill: while a long prompt is fed in chunks before the first pass: ``(tokens fed, tokens to feed)``
            over both sides; None otherwise.
    """

    turn: Turn
    standard: GenerationResult
    mtp: GenerationResult
    standard_done: bool = False
    mtp_done: bool = False
    phase: str = "running"
    error: str | None = None
    wall_seconds: float = 0.0
    last: str | None = None
    quality: Quality | None = None
    prefill: tuple[int, int] | None = None
    _speed: Any = field(default=None, repr=False)

    @property
    def final(self) -> bool:
        """True for the last state of a turn."""
        return self.phase != "running"

    @property
    def strategy(self) -> Strategy:
        """The MTP side's strategy."""
        return self.turn.strategy

    @property
    def speed(self) -> SpeedEstimate | None:
        """:func:`estimate_speedup` of the passes so far (computed once per state)."""
        if self._speed is None:
            self._speed = estimate_speedup(self.standard.passes, self.mtp.passes) or False
        return self._speed or None

    @property
    def identical(self) -> bool:
        """Both answers are the same text."""
        return self.standard.text == self.mtp.text

    @property
    def parted_at(self) -> int | None:
        """The first token position (0-based) where the two answers differ; None while one answer is a
        prefix of the other (a side that is ahead while the turn runs, or after Stop) or both are the same."""
        pairs = zip(self.standard.token_ids, self.mtp.token_ids)
        return next((i for i, (a, b) in enumerate(pairs) if a != b), None)


def run_turn(
    turn: Turn,
    should_stop: Callable[[], str | None] = lambda: None,
    *,
    passes: PassScheduler | None = None,
) -> Iterator[TurnState]:
    """Run a turn: standard decoding and ``turn.strategy`` on the same prompt, one pass each in turn.

    The two sides alternate in ABBA order (pair i runs standard first when i is even, MTP first
    when odd); each pass goes through ``passes`` (:class:`app.passes.PassScheduler`), which may carry other
    sessions' rows in it but never the other side's. The side that finishes first stops taking turns.

    Args:
        turn: from :func:`prepare_turn`.
        should_stop: polled before every pass; a reason (``"stopped"``, ``"cleared"``) ends the
            turn with that phase.
        passes: where the passes run (the page's :data:`app.passes.SHARED` by default).

    A prompt longer than one chunk (:data:`~model.engine.decoding.PREFILL_CHUNK` tokens) is fed first, chunk by
    chunk, the sides alternating (:meth:`app.passes.PassScheduler.run_prefill`): ``should_stop`` is polled between
    chunks, so Stop waits one chunk at most; the chunks' time counts in each side's first pass (its prefill).

    Yields:
        A :class:`TurnState` before the first pass and after every pass or prompt chunk (``phase == "running"``),
        then one final state
        (``done``, ``stopped``, ``cleared`` or ``error``). Engine errors (context budget, NaN
        logits, anything else) become ``phase == "error"`` with a message; nothing is raised. A turn
        that ends done or stopped is scored first (:func:`score_answers`: one pass per answer, not timed):
        its final state carries :attr:`TurnState.quality`.
    """
    t0 = time.perf_counter()
    passes = passes if passes is not None else SHARED
    sides: dict[str, Decoder] = turn.sides

    to_prefill = sum(d.prefill_left for d in sides.values())

    def state(phase: str = "running", error: str | None = None, last: str | None = None) -> TurnState:
        std, mtp = sides["standard"].result(), sides["mtp"].result()
        quality = score_answers(turn, std, mtp, passes.lock) if phase in ("done", "stopped") else None
        left = sum(d.prefill_left for d in sides.values())
        return TurnState(turn, std, mtp, sides["standard"].done, sides["mtp"].done, phase, error,
                         time.perf_counter() - t0, last, quality, (to_prefill - left, to_prefill) if left else None)

    yield state()  # the turn has started: no pass yet
    with passes.client() as client:
        # A long prompt first, in chunks, the sides alternating: Stop acts between chunks.
        while any(d.prefill_left > PREFILL_CHUNK for d in sides.values()):
            for name, d in sides.items():
                if d.prefill_left <= PREFILL_CHUNK:
                    continue
                reason = should_stop()
                if reason:
                    yield state(reason if reason in PHASES else "stopped")
                    return
                error = _run_step(lambda: passes.run_prefill(d, client))
                if error is not None:
                    yield state("error", error, name)
                    return
                yield state(last=name)
        pair = 0
        while not all(d.done for d in sides.values()):
            for name in (("standard", "mtp") if pair % 2 == 0 else ("mtp", "standard")):
                if sides[name].done:
                    continue
                reason = should_stop()
                if reason:
                    yield state(reason if reason in PHASES else "stopped")
                    return
                error = _run_pass(passes, sides[name], client)
                if error is not None:
                    yield state("error", error, name)
                    return
                yield state(last=name)
            pair += 1
    yield state("done")


def _run_pass(passes: PassScheduler, decoder: Decoder, client: object) -> str | None:
    """One pass of ``decoder``; the page's message if it failed, else None."""
    return _run_step(lambda: passes.run_pass(decoder, client))


def _run_step(step: Callable[[], object]) -> str | None:
    """Run one pass or prefill chunk; the page's message if it failed, else None."""
    try:
        step()
    except NonFiniteLogitsError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - the page shows a message and keeps serving
        log.exception("forward pass failed")
        return f"The forward pass failed: {type(e).__name__}: {e}"
    return None


def history_after(state: TurnState) -> list[dict]:
    """The conversation after a turn: its history, the user's message and the standard answer as
    context (the MTP answer rides along as ``"mtp"``, shown in its pane only). A cleared turn
    leaves an empty conversation; a turn that failed before any pass leaves the history unchanged
    (the page puts the message back in the box); a turn stopped early keeps its partial answers."""
    if state.phase == "cleared":
        return []
    if state.phase == "error" and not state.standard.passes and not state.mtp.passes:
        return list(state.turn.history)
    return list(state.turn.history) + [
        {"role": "user", "content": state.turn.message},
        {"role": "assistant", "content": state.standard.text, "mtp": state.mtp.text},
    ]
