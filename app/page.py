"""The page's behaviour: every event handler of the Gradio page as a method of :class:`Page`, testable without a
browser (paper arXiv 2602.06019, sections 3.4 and 4.5). :mod:`app.ui` lays out the components and wires them to
these methods; nothing here builds a component.

A turn: :meth:`Page.chat` (the page) or :meth:`Page.chat_api` (API clients) takes the message's place in its
session (:mod:`app.sessions`: it waits behind a turn still answering), then :meth:`Page.generate_turn` (on a
ZeroGPU Space, in a GPU worker) prepares and runs it (:mod:`app.turn`) and turns its states into component updates
(:mod:`app.outputs`). Bad input never raises into Gradio: it becomes a message in the page.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterator

import gradio as gr

from model.engine.loading import DEFAULT_SOURCE
from model.errors import RequestError

from . import render, tradeoff
from .api import ApiHandlers
from .device import WidthProfile, progress_of
from .headline import turn_status
from .outputs import (TURN_OUTPUTS, box_command, cleared_outputs, error_outputs, notice_html, outputs_of,
                      refused_outputs, turn_outputs)
from .passes import SHARED, PassScheduler
from .prefixes import PrefixStore
from .quality import answer_point
from .registry import ModelRegistry
from .requests import (STRATEGY_CHOICES, TurnRequest, app_k_max, check_page_controls, check_settings, k_max_limit,
                       load_examples, parse_history, parse_source)
from .scripts import REPEAT, message_number
from .sessions import MAX_WAITING, SessionRuns, stop_requested
from .timing import width_pairs
from .turn import history_after, prepare_turn, run_turn
from .zerogpu import GPU_SWEEP_SECONDS, gpu_seconds, on_gpu, zero_gpu

log = logging.getLogger(__name__)

#: Seconds between re-renders of the figures while answers stream.
FIGURE_EVERY_S = float(os.environ.get("MTP_APP_FIGURE_EVERY_S", "0.6"))
#: Seconds between updates of the panes and counters while answers stream.
PANE_EVERY_S = float(os.environ.get("MTP_APP_PANE_EVERY_S", "0.12"))
#: Seconds a message waits for one the page sent before it that has not reached the server, before it starts anyway.
ORDER_GRACE_S = 2.0


def session_of(request: Any) -> str | None:
    """The page session of a Gradio request (None for a call without one)."""
    return getattr(request, "session_hash", None)


class Page(ApiHandlers):
    """What the page does, one method per event (module docstring).

    Args:
        registry: where models are loaded and cached (a fresh :class:`~app.registry.ModelRegistry` by default).
        sessions: the sessions' turns and records (a fresh :class:`~app.sessions.SessionRuns` by default).
        passes: where every forward pass runs (:data:`app.passes.SHARED` by default).
        preload: load the default model now and measure its width profile (so the first answer waits for
            neither, and the page can say what this device does to MTP's speed before it).
    """

    def __init__(self, registry: ModelRegistry | None = None, sessions: SessionRuns | None = None,
                 passes: PassScheduler | None = None, *, preload: bool = True):
        self.registry = registry or ModelRegistry()
        self.sessions = sessions or SessionRuns()
        self.passes = passes or SHARED
        self.facts = self.registry.facts
        self.zero_gpu = zero_gpu()
        self.prefixes = PrefixStore()  # each conversation's KV caches between turns (not across ZeroGPU workers)
        self.examples = load_examples()
        self.default_key = ModelRegistry.key(DEFAULT_SOURCE, "none")
        self.default_k_max = app_k_max()
        self.default_info = ""
        if preload:
            self._preload()
        # On a ZeroGPU Space these run in a GPU worker, with a GPU for about as long as they can take.
        self.generate = on_gpu(self.generate_turn, gpu_seconds)
        self.sweep = on_gpu(self.sweep_gpu, GPU_SWEEP_SECONDS)

    def _preload(self) -> None:
        try:
            lm = self.registry.get(*self.default_key)
            self.default_info = render.model_html(lm)
            self.default_k_max = app_k_max(lm.default_k_max)
            if not self.zero_gpu:  # on ZeroGPU the GPU exists only inside a turn: measured there on first use
                self.facts.profile(self.default_key, lm)
        except RequestError as e:
            self.default_info = render.status_html(str(e), kind="error")

    # ------------------------------------------------------------ what the model trades here
    def key_of(self, key: Any) -> tuple:
        """A model key from the page's state (the default model's when empty)."""
        return tuple(key or self.default_key)

    def loaded(self, key: Any) -> Any:
        """The loaded model of ``key`` if it is loaded (never loads one)."""
        key = self.key_of(key)
        return self.registry.get(*key) if key in self.registry.loaded() else None

    def help_html(self, choice: Any, key: Any, k_max_value: Any, shape_choice: Any) -> str:
        """The strategy's help line; for lossless, with the shape this device runs at the k_max box's value."""
        line = ""
        lm = self.loaded(key)
        if choice == "lossless" and lm is not None:
            key = self.key_of(key)
            limit = k_max_limit(k_max_value, app_k_max(lm.default_k_max))
            shape_choice = str(shape_choice or "fastest here")
            shape = self.facts.shape(key, lm, limit, measure=False) if shape_choice == "fastest here" else None
            line = render.shape_text(shape, self.facts.profile(key), shape_choice, limit,
                                     self.facts.profile_error(key))
        return render.strategy_help_html(str(choice or "ConfAdapt"), line)

    def fastest(self, key: Any) -> Any:
        """The fastest lossless shape for the model's own k_max (the device note's offer), or None."""
        lm = self.loaded(key)
        return None if lm is None else self.facts.shape(self.key_of(key), lm, app_k_max(lm.default_k_max),
                                                         measure=False)

    def device_outputs(self, key: Any) -> tuple:
        """(device note, its button)."""
        best = self.fastest(key)
        note = render.device_note_html(self.facts.profile(self.key_of(key)), best)
        k = best.k_max if best is not None else 1
        return note, gr.update(visible=bool(note), value=f"Use the fastest lossless setting here (k_max {k})")

    def tradeoff_fig(self, key: Any, tau_value: Any, k_max_value: Any, choice: Any, session: str | None):
        """The trade-off figure: the checkpoint's sweep, the current tau and this session's answers."""
        key = self.key_of(key)
        sweep, source = self.facts.sweep(key, self.loaded(key))
        return tradeoff.tradeoff_figure(sweep, tau=tau_value if choice == "ConfAdapt" else None,
                                       k_max=k_max_limit(k_max_value, None), answers=self.sessions.points(session, key),
                                       source=source)

    def measure_visible(self, key: Any) -> Any:
        """The Measure button shows while the model has no sweep."""
        key = self.key_of(key)
        return gr.update(visible=self.facts.sweep(key, self.loaded(key))[0] is None)

    # ------------------------------------------------------------ a turn
    def generate_turn(self, request: TurnRequest) -> Iterator[tuple]:
        """Prepare and run a turn, rendering its states. Yields ``(outputs, final, history after, extra)`` (the
        history with this turn's partial answers while it runs; None when the turn could not start), ``extra``
        the plain values the main process keeps: the finished answer's trade-off point and the model's width
        profile (measured here on first use on ZeroGPU). ``request.stream`` False renders the first and the final
        state only. On a ZeroGPU Space this runs in a GPU worker (arguments and yields pickled); Stop / Clear reach
        it through the run's stop flag file, polled before every forward pass."""
        try:
            turn = prepare_turn(self.registry, request, None if self.zero_gpu else self.prefixes)
        except RequestError as e:
            yield error_outputs(str(e)), True, None, {}
            return
        except Exception as e:  # noqa: BLE001 - never a traceback in the page
            log.exception("preparing a turn failed")
            yield error_outputs(f"Could not start this turn: {type(e).__name__}: {e}"), True, None, {}
            return
        last_pane = last_fig = -1e9
        fig_every, first, shown_status = FIGURE_EVERY_S, True, None
        for state in run_turn(turn, lambda: stop_requested(request.run_id), passes=self.passes):
            now = time.perf_counter()
            if not (first or state.final or (request.stream and now - last_pane >= PANE_EVERY_S)):
                continue
            due = now - last_fig >= fig_every
            status = turn_status(state)
            with self.passes.lock:  # no forward pass of any session runs while this renders
                out = turn_outputs(state, figures_due=due, first=first, status_due=status != shown_status)
            shown_status = status
            last_pane, first = now, False
            if due:  # the figures grow with the answer: rendering takes at most a quarter of the time
                last_fig = now
                fig_every = max(FIGURE_EVERY_S, 3 * (time.perf_counter() - now))
            extra = {}
            if state.final:
                prof = self.facts.profile(turn.model_key)
                extra = {"point": answer_point(state), "profile": prof.to_dict() if prof else None,
                         "width_pairs": width_pairs(state.standard.passes, state.mtp.passes)}
                if state.phase in ("done", "stopped") and not self.zero_gpu:  # the next turn starts from here
                    self.prefixes.put(request.session, turn.model_key,
                                      {name: (d.cache, d.cached_ids) for name, d in turn.sides.items()})
            yield out, state.final, history_after(state), extra

    def turn_updates(self, request: TurnRequest, session: str | None, seq: int | None = None) -> Iterator[tuple]:
        """A turn in its session, as :data:`~app.outputs.TURN_OUTPUTS` tuples: the message waits behind the
        session's turn still answering (a notice says so), then runs as the session's next turn, continuing its
        conversation as the server recorded it (:meth:`~app.sessions.SessionRuns.conversation`). ``session`` None
        (API and MCP clients): no queue, no record, the history sent is the conversation."""
        self.sessions.arrive(session, seq)  # refused or not, a later message need not wait for this one
        try:
            check_settings(request)  # a message refused never takes a place in the queue (it stays in the box)
        except RequestError as e:
            self.sessions.settle(session)
            # the status line stays the session's turn's (answering or ended): the notice says why
            yield error_outputs(str(e), in_notice=self._status_shows_a_turn(session))
            return
        ticket = self.sessions.enter(session, seq)
        if ticket is None:
            self.sessions.settle(session)
            yield refused_outputs(f"{MAX_WAITING} messages already wait for the answer in progress; this one stays "
                                  "in the box. Send it when one of them has started, or press Stop.")
            return
        with ticket:
            waited = not ticket.started.is_set()
            if waited:
                running, ahead = self.sessions.current(session), self.sessions.waiting(session) - 1
                n = f" (turn {running.turn_number})" if running is not None and running.turn_number else ""
                after = f", then for the {ahead} message sent before it" if ahead == 1 else ""
                yield outputs_of(message="", notice=notice_html(
                    f"Your message waits for the answer in progress{n} to end{after}, and is answered then; Stop "
                    "ends that answer now."))
                while not ticket.wait_turn(ORDER_GRACE_S):
                    self.sessions.promote(session)  # held for an earlier message that never came
            try:
                sent = parse_history(request.history)
            except RequestError as e:
                yield error_outputs(str(e))
                return
            conversation = self.sessions.conversation(session, sent)
            ticket.turn_number = sum(1 for m in conversation if m["role"] == "user") + 1
            request = request.with_(history=conversation, run_id=ticket.run_id, model_key=self.key_of(request.key),
                                    session=session)
            yield from self._run_ticket(request, ticket, session, taken=waited,
                                        earlier=session is not None and ticket.turn_number > 1)

    def _run_ticket(self, request: TurnRequest, ticket: Any, session: str | None, earlier: bool = False,
                    taken: bool = False) -> Iterator[tuple]:
        """The turn's updates; the conversation is recorded on the ticket as it goes (kept when the run ends). A
        turn refused at its start (a prompt over the limit) leaves the status line to an earlier turn's outcome
        (``earlier``) and says why in the notice, and puts its message back into the box if it was ``taken`` from
        it (it waited)."""
        for out, final, after, extra in self.generate(request):
            if after is None and final:
                out = error_outputs(out[TURN_OUTPUTS.index("result")]["status"], in_notice=earlier)
                out = (str(request.message),) + out[1:] if taken else out
            if after is not None:
                ticket.record(after)
            if final:  # a run that ends as Clear is pressed adds no point: its answer is gone
                self._keep_extra(request.key, session, extra, point=ticket.stop_reason() != "cleared")
                out = list(out)
                # where the controls are now: the slider may have moved while the turn answered
                choice, tau, k_max = self.sessions.controls(session, (request.strategy, request.tau, request.k_max))
                out[TURN_OUTPUTS.index("tradeoff")] = self.tradeoff_fig(request.key, tau, k_max, choice, session)
                out = tuple(out)
            reason = ticket.stop_reason()
            if reason is not None and not final:
                continue  # Stop / Clear already answered the page: a late running update must not undo it
            if reason == "cleared":
                # the last word after Clear is Clear's page, whatever the run's phase (it may have finished while
                # Clear was pressed): it also covers a running update still on its way to the page
                choice = request.strategy if request.strategy in STRATEGY_CHOICES else "ConfAdapt"
                out = cleared_outputs(choice) if final else out
            yield out

    def _status_shows_a_turn(self, session: str | None) -> bool:
        """Whether the page's status line shows a turn of ``session`` (one answering, or the last one's outcome):
        a message refused then is explained in the notice, and that status stays."""
        return self.sessions.current(session) is not None or bool(self.sessions.conversation(session, []))

    def _keep_extra(self, key: tuple, session: str | None, extra: dict, point: bool = True) -> None:
        if extra.get("profile") and self.facts.profile(key) is None:
            self.facts.put_profile(key, WidthProfile.from_dict(extra["profile"]))
        self.facts.observe(key, extra.get("width_pairs") or [])  # the device's width cost, as the page runs it
        if point and extra.get("point"):
            self.sessions.add_point(session, extra["point"])

    def chat(self, message, history, strategy, tau, k_max, k, max_new_tokens, shape, model_key, temperature=0.0,
             top_p=1.0, seq=None, request: gr.Request = None) -> Iterator[tuple]:
        """The page's Send / Enter: the turn's updates, the message box changed only by command
        (:func:`~app.outputs.box_command`: a message the user typed since is never replaced). An empty box of the
        controls the strategy uses is refused (:func:`~app.requests.check_page_controls`), never read as a
        default. ``seq``: the page's number for the message (its script counts Sends), so that two messages sent
        moments apart are answered in the order they were sent (:meth:`~app.sessions.SessionRuns.enter`)."""
        if seq == REPEAT:  # the message just sent, sent again at once (a double click): nothing changes
            yield outputs_of()
            return
        sent = "" if message is None else str(message)
        seq = message_number(seq)
        try:
            check_page_controls(strategy, tau, k_max, k)
        except RequestError as e:
            self.sessions.arrive(session_of(request), seq)
            self.sessions.settle(session_of(request))
            out = error_outputs(str(e), in_notice=self._status_shows_a_turn(session_of(request)))
            yield (box_command(out[0], sent),) + tuple(out[1:])
            return
        turn = TurnRequest(message, history, strategy, tau, k_max, k, max_new_tokens, model_key, shape,
                           temperature=temperature, top_p=top_p)
        self.sessions.set_controls(session_of(request), strategy, tau, k_max)
        for out in self.turn_updates(turn, session_of(request), seq):
            yield (box_command(out[0], sent),) + tuple(out[1:])

    def stop(self, seq=None, request: gr.Request = None):
        """Stop: the session's running answer ends before its next pass or prompt chunk (a waiting message then
        starts). Acknowledged at once in the notice; the run then says it stopped. ``seq``: the page's number of
        the last message sent before the click (its script fills it in); a turn numbered after it is not stopped,
        as its message was sent after the click (:meth:`app.sessions.SessionRuns.request_stop`)."""
        if self.sessions.request_stop(session_of(request), "stopped", upto=message_number(seq)):
            return notice_html("Stopping: the answer ends after the pass in progress.")
        return notice_html("Nothing is running.", "info")

    def clear(self, strategy_choice, key=None, tau_value=None, k_max_value=None, request: gr.Request = None):
        """Clear: the running answer ends; the conversation and its points in the trade-off figure are gone."""
        session = session_of(request)
        self.sessions.request_stop(session, "cleared")
        self.sessions.remember(session, [])
        self.sessions.drop_points(session)
        self.prefixes.drop(session)
        out = dict(zip(TURN_OUTPUTS, cleared_outputs(strategy_choice)))
        out["tradeoff"] = self.tradeoff_fig(key, tau_value, k_max_value, strategy_choice, session)
        return tuple(out.values())[1:]

    # ------------------------------------------------------------ controls
    def on_strategy(self, choice, key, k_max_value, shape_choice, tau_value, request: gr.Request = None):
        """The strategy changed: which controls show, the help line and the trade-off figure."""
        return (gr.update(visible=choice == "ConfAdapt"), gr.update(visible=choice in ("ConfAdapt", "lossless")),
                gr.update(visible=choice == "static k"), gr.update(visible=choice == "lossless"),
                self.help_html(choice, key, k_max_value, shape_choice),
                self.on_tau(choice, key, k_max_value, tau_value, request))

    def on_controls(self, choice, key, k_max_value, shape_choice, tau_value, request: gr.Request = None):
        """k_max or the shape changed: the help line and the trade-off figure (cheap: no model call)."""
        return (self.help_html(choice, key, k_max_value, shape_choice),
                self.on_tau(choice, key, k_max_value, tau_value, request))

    def on_tau(self, choice, key, k_max_value, tau_value, request: gr.Request = None):
        """The tau slider moved: only the trade-off figure's marker is redrawn (the session's controls noted)."""
        self.sessions.set_controls(session_of(request), choice, tau_value, k_max_value)
        return self.tradeoff_fig(key, tau_value, k_max_value, choice, session_of(request))

    def use_fastest(self, key):
        """The device note's button: lossless at the fastest shape here."""
        best = self.fastest(key)
        return "lossless", best.k_max if best is not None else 1, "fastest here"

    # ------------------------------------------------------------ models
    def load(self, choice, local_path, quantization, precision):
        """(key, model) or a RequestError. Measures the width profile of a newly loaded model."""
        key = ModelRegistry.key(parse_source(choice, local_path), quantization, precision)
        lm = self.registry.get(*key)
        if not self.zero_gpu:
            self.facts.profile(key, lm)
        return key, lm

    def load_model(self, choice, local_path, quantization, precision, model_key, strategy_choice, shape_choice,
                   tau_value, request: gr.Request = None):
        """Load model: the model's info, k_max, device note and figures; an error keeps the current model."""
        try:
            key, lm = self.load(choice, local_path, quantization, precision)
        except RequestError as e:
            text = f"{e} Still using {self.key_of(model_key)[0]}."
            return (model_key, gr.skip(), render.status_html(text, kind="error")) + (gr.skip(),) * 6
        k = app_k_max(lm.default_k_max)
        note, button = self.device_outputs(key)
        return (key, render.model_html(lm, key[1]), render.status_html(f"Loaded {key[0]}."), k, note, button,
                self.help_html(strategy_choice, key, k, shape_choice),
                self.tradeoff_fig(key, tau_value, k, strategy_choice, session_of(request)), self.measure_visible(key))

    # ------------------------------------------------------------ the trade-off
    def sweep_gpu(self, model_key) -> Iterator[tuple]:
        """Measure the trade-off (the GPU part): yields ``("progress", (done, total))``, then ``("result", sweep)``
        or ``("error", message)``; plain values only (a ZeroGPU worker pickles them)."""
        key = self.key_of(model_key)
        try:
            lm = self.registry.get(*key)
        except RequestError as e:
            yield "error", str(e)
            return
        for kind, value in progress_of(lambda cb: self.facts.measure_sweep(key, lm, self.examples, on_progress=cb)):
            if kind == "error":
                log.error("measuring the trade-off failed: %r", value)
                value = f"{type(value).__name__}: {value}"
            yield kind, value

    def measure(self, model_key, tau_value, k_max_value, strategy_choice, shape_choice, request: gr.Request = None,
                progress=gr.Progress()):
        """Measure the trade-off: the figure, the status, the button, the help line and the device note."""
        key = self.key_of(model_key)
        progress(0.0, desc="measuring the trade-off")
        t0 = time.perf_counter()
        for kind, value in self.sweep(key):
            if kind == "progress":
                done, total = value
                progress(done / max(total, 1), desc=f"{done} of {total} answers")
            elif kind == "result":
                self.facts.put_sweep(key, value)
                text = (f"Measured the trade-off on {value.n_prompts} example prompts "
                        f"({value.max_new_tokens} tokens each) in {time.perf_counter() - t0:.0f} s.")
                note, button = self.device_outputs(key)
                return (self.tradeoff_fig(key, tau_value, k_max_value, strategy_choice, session_of(request)),
                        render.status_html(text), self.measure_visible(key),
                        self.help_html(strategy_choice, key, k_max_value, shape_choice), note, button)
            else:
                return (gr.skip(), render.status_html(f"Measuring the trade-off failed: {value}", kind="error"),
                        *(gr.skip(),) * 4)
        return (gr.skip(), render.status_html("Measuring the trade-off ended without a result.", kind="error"),
                *(gr.skip(),) * 4)

