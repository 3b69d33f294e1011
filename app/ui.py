"""The Gradio page: layout and event wiring only (paper arXiv 2602.06019, sections 3.4 and 4.5).

Every user turn is answered by standard decoding (left) and by the chosen MTP strategy (right:
ConfAdapt, static k or lossless verification), both on the same conversation. A turn is prepared
and run by :mod:`app.runner` (no Gradio there), drawn by :mod:`app.render` (HTML) and
:mod:`app.figures` (Plotly); this module lays out the page and turns runner states into component
updates. Bad input never raises into Gradio: it becomes a message in the page (the status line, never a
toast over the controls), and the message box keeps the text.

API clients (``gradio_client``) get plain values: ``/chat`` and ``/load_model`` are events of their own
whose outputs are complete values (the page's own events may skip outputs, which a client would receive
as Gradio's raw update dicts), on hidden components of their own: free-form inputs (the README's vocabulary,
which the page's radio buttons would refuse) and outputs labelled with their names (``view_api()``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import gradio as gr
import spaces  # ZeroGPU's decorator; a no-op anywhere else (app.py imports it before torch)

from model.engine.loading import DEFAULT_SOURCE
from model.engine.strategies import DEFAULT_K_MAX, DEFAULT_STATIC_K, DEFAULT_TAU
from model.errors import RequestError

from . import figures, render
from .device import SHAPE_CHOICES, SWEEP_MAX_NEW_TOKENS, SWEEP_TAUS, WidthProfile, progress_of
from .runner import (
    APP_MAX_K_MAX,
    APP_MAX_NEW_TOKENS,
    DEFAULT_MAX_NEW_TOKENS,
    PRECISIONS,
    QUANTIZATIONS,
    STRATEGY_CHOICES,
    ModelRegistry,
    SessionRuns,
    TurnState,
    answer_point,
    choice_of,
    exclusive,
    gpu_seconds,
    history_after,
    parse_history,
    parse_source,
    prepare_turn,
    run_turn,
    stop_requested,
)

log = logging.getLogger(__name__)

PAPER_URL = "https://arxiv.org/abs/2602.06019"
EXAMPLES_FILE = Path(__file__).resolve().parent.parent / "assets" / "examples.json"
#: Model dropdown: the embedded default and the authors' released checkpoint(s) by hub id.
MODEL_CHOICES = [
    ("SmolLM2-135M-Instruct (embedded default)", DEFAULT_SOURCE),
    ("Llama-3.1-8B-Magpie-MTP (authors, hub; GPU)", "jwkirchenbauer/L3-1-8B-Magpie-MTP"),
    ("Qwen3-4B-Instruct-2507-MTP (authors, hub; GPU)", "jwkirchenbauer/Qwen3-4B-Inst-2507-MTP"),
]
#: Seconds between re-renders of the figures while answers stream.
FIGURE_EVERY_S = float(os.environ.get("MTP_APP_FIGURE_EVERY_S", "0.6"))
#: Seconds between updates of the panes and counters while answers stream.
PANE_EVERY_S = float(os.environ.get("MTP_APP_PANE_EVERY_S", "0.12"))
#: Sessions generating at once (their forward passes still run one at a time).
CONCURRENCY = int(os.environ.get("MTP_APP_CONCURRENCY", "4"))

STD_TITLE = "Standard decoding: one token per forward pass"
LIKE_WITH_LIKE = ("Both panes answer the same conversation: from turn 2 on, the earlier turns carry the standard "
                  "answer (left) as context, so the two sides always answer the same prompt and their times compare "
                  "like with like.")

#: Outputs of a turn, in this order (the /chat API returns them in this order too, as plain values).
TURN_OUTPUTS = ("message", "history", "chat_std", "chat_mtp", "stats_std", "stats_mtp", "speed", "coloured",
                "figure", "race", "table", "status", "notice", "tradeoff", "result")
#: Seconds a message sent right after Stop waits for the stop to reach the running turn (the two
#: requests travel separately; Stop's may arrive second).
STOP_GRACE_S = float(os.environ.get("MTP_APP_STOP_GRACE_S", "1.5"))
#: Seconds a ZeroGPU worker is asked for to measure the trade-off (the example prompts, few taus).
GPU_SWEEP_SECONDS = 120

CSS = """
.mtp-header h1 {margin: 0 0 .2em; font-size: 1.6em}
.mtp-header p {margin: .2em 0}
#status, #notice {min-height: 0}
.mtp-status {padding: 2px 0}
.mtp-error {color: var(--error-text-color, #b91c1c)}
.mtp-notice {padding: 4px 8px; border-radius: 6px; background: #fff4d6; color: #4a3500}
.mtp-model {font-size: .9em}
.mtp-strategy-help {font-size: .9em}
.mtp-pane {border: 1px solid var(--border-color-primary); border-radius: 8px;
  background: var(--block-background-fill); display: flex; flex-direction: column; min-width: 0}
.mtp-pane-title {font-weight: 600; font-size: .9em; padding: 6px 10px;
  border-bottom: 1px solid var(--border-color-primary)}
.mtp-scroll {min-height: 140px; max-height: 400px; overflow-y: auto; display: flex; flex-direction: column-reverse;
  padding: 4px 8px}
.mtp-msg {margin: 6px 0; padding: 6px 10px; border-radius: 8px; unicode-bidi: plaintext}
.mtp-msg-text {white-space: pre-wrap; overflow-wrap: break-word}
.mtp-user {background: var(--color-accent-soft, #e8eefc); margin-inline-start: 12%}
.mtp-bot {background: var(--background-fill-secondary, #f5f5f5); margin-inline-end: 4%}
.mtp-code {white-space: pre; overflow-x: auto; background: #f6f8fa; color: #1f2328; padding: 8px;
  border-radius: 6px; margin: 4px 0; font-size: .85em; direction: ltr; text-align: left}
.mtp-fence {display: none}
.mtp-cursor {opacity: .5}
.mtp-note {font-size: .8em; color: var(--body-text-color-subdued); margin: -2px 0 6px}
.mtp-empty {color: var(--body-text-color-subdued); font-size: .9em; padding: 8px 0}
.mtp-counters {font-size: .9em; padding: 4px 2px}
.mtp-counter-row {display: flex; flex-wrap: wrap; gap: 4px 14px; margin-top: 2px}
.mtp-counter {display: flex; flex-direction: column; white-space: nowrap; cursor: help}
.mtp-counter-name {font-size: .78em; color: #4b5563}
.dark .mtp-counter-name, .dark .mtp-speed-details {color: #d1d5db}
.mtp-counter-value {font-weight: 600; font-variant-numeric: tabular-nums}
.mtp-caption {font-size: .85em}
.mtp-caption p {margin: .3em 0}
.mtp-speed {padding: 6px 10px; border-left: 4px solid #757575; background: var(--background-fill-secondary)}
.mtp-speed.mtp-faster {border-left-color: #2e7d32}
.mtp-speed.mtp-slower {border-left-color: #c62828}
.mtp-speed.mtp-warn {border-left-color: #e65100; background: #fff3e0; color: #3e2100}
.mtp-headline {font-size: 1.05em}
.mtp-speed-details {font-size: .82em; margin-top: 3px; color: #4b5563}
.mtp-warn .mtp-speed-details {color: #5d3a1a}
.mtp-shape {margin-top: 3px; font-size: .95em}
.mtp-device-note {padding: 6px 10px; border-radius: 6px; background: #e8f0fe; color: #0d2a59; font-size: .9em}
#device-note:not(:has(.mtp-device-note)) {display: none}
.mtp-measure-status {font-size: .85em}
#model-choice input {min-width: 0; text-overflow: ellipsis; padding-inline-end: 2.2em}
.mtp-fig1-wrap {border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px 10px}
.mtp-fig1 {white-space: pre-wrap; overflow-wrap: break-word; line-height: 1.9; unicode-bidi: plaintext}
.mtp-blk {border-radius: 2px}
.mtp-multi {box-shadow: inset -1px 0 rgba(0,0,0,.3); -webkit-box-decoration-break: clone; box-decoration-break: clone}
.mtp-blk:hover {outline: 2px solid #333}
.mtp-nl::before {content: "↵"; opacity: .5}
.mtp-tab::before {content: "⇥"; opacity: .5}
.mtp-legend {font-size: .85em; margin-bottom: 6px; display: flex; flex-wrap: wrap; gap: 4px; align-items: center}
.mtp-legend-item {display: inline-block; min-width: 1.7em; text-align: center; border-radius: 3px; padding: 0 4px;
  font-weight: 600; border: 1px solid rgba(0,0,0,.25)}
.mtp-legend-hint, .mtp-fig1-empty, .mtp-table-empty {color: var(--body-text-color-subdued)}
.mtp-fig-caption {font-size: .85em; margin: 0 0 4px}
.mtp-swatch {display: inline-block; width: .9em; height: .9em; border-radius: 2px; vertical-align: -1px}
.mtp-table-wrap {overflow-x: auto; max-height: 440px; overflow-y: auto}
.mtp-table {border-collapse: collapse; font-size: .82em}
.mtp-table th, .mtp-table td {white-space: nowrap; padding: 2px 6px; text-align: right;
  border-bottom: 1px solid var(--border-color-primary)}
.mtp-table th {position: sticky; top: 0; background: var(--block-background-fill)}
.mtp-table th:last-child {text-align: start}
.mtp-table td.mtp-td-text {white-space: pre; text-align: start; min-width: 7em; max-width: 24em; overflow: hidden;
  text-overflow: ellipsis}
#notice:not(:has(.mtp-notice)), #status:not(:has(.mtp-status)) {display: none}
#examples button {white-space: nowrap; overflow: hidden; text-overflow: ellipsis; max-width: 100%}
@media (max-width: 640px) {
  .mtp-table {font-size: .74em}
  .mtp-table th, .mtp-table td {padding: 2px 3px}
  .mtp-table td.mtp-td-text {min-width: 4em; max-width: 7em}
  .mtp-wide {display: none}
  .mtp-scroll {max-height: 260px}
  .mtp-header h1 {font-size: 1.25em}
  .mtp-header p {font-size: .9em}
}
"""

#: Page-level CSS that Gradio would scope under its content container (it only reaches ancestors from
#: the document's head): narrower page margins on phones.
HEAD = """<style>
@media (max-width: 640px) { .gradio-container .main.app {padding-left: 8px !important; padding-right: 8px !important} }
</style>"""



def load_examples(path: Path = EXAMPLES_FILE) -> list[str]:
    """Example prompts from ``assets/examples.json`` (a list of ``{"kind", "prompt"}``)."""
    try:
        return [e["prompt"] for e in json.loads(path.read_text())]
    except (OSError, ValueError, KeyError, TypeError):
        return ["What is 12 times 7? Think step by step."]


def header_html() -> str:
    """The page's title and two sentences on what it shows."""
    return (
        '<div class="mtp-header"><h1>MTP Lens: multi-token prediction, side by side</h1>'
        "<p><b>MTP</b> lets an ordinary language model propose a block of up to k_max tokens in one forward pass "
        "by appending mask tokens (<a href=\"" + PAPER_URL + "\" target=\"_blank\" rel=\"noopener\">Kirchenbauer "
        "et al., <i>Multi-Token Prediction via Self-Distillation</i></a>). <b>ConfAdapt</b> always keeps the first "
        "proposal (the model's ordinary next token) and then the following ones while their confidence is at least "
        "tau; <b>lossless</b> verification keeps only proposals the model itself confirms, so its answer equals "
        "standard decoding's (to the bit on our CPU kernels, in bf16 as in float32).</p><p class=\"mtp-wide\">Each message is answered twice: standard decoding on the left, "
        "MTP on the right, their forward passes alternating on one worker so that each is timed alone.</p></div>")


def figure_caption(strategy_choice: str) -> str:
    """The legend of the animated figure's colours for a strategy."""
    def sw(colour: str) -> str:
        return f'<span class="mtp-swatch" style="background:{colour}"></span>'
    if strategy_choice == "lossless":
        body = (f"{sw(figures.DRAFT_OK)} ✓ draft accepted (equals the model's own choice) · {sw(figures.DRAFT_BAD)} "
                f"✗ draft rejected · {sw(figures.OWN)} → the model's own token, always kept (its correction, or its "
                f"next token) · {sw(figures.NEW_DRAFT)} the mask block that followed the accepted drafts: the next pass's "
                f"drafts · {sw(figures.UNUSED_BLOCK)} a mask block that did not (not used). Height: the model's "
                "confidence at that place")
    else:
        body = (f"{sw(figures.FIRST)} the first proposal, the model's next token: always kept, whatever its "
                f"confidence · {sw(figures.KEPT)} kept · {sw(figures.CUT)} accepted, then cut by a stop token or the token "
                f"limit · {sw(figures.REJECTED)} dropped"
                + (" · dashed line: tau" if strategy_choice == "ConfAdapt" else ""))
    return f'<p class="mtp-fig-caption">Forward passes of the MTP side, one frame each (▶ Play). {body}</p>'


def figure_html(state: TurnState | None, strategy_choice: str = "ConfAdapt") -> str:
    """Caption + the animated figure of the MTP side's passes."""
    records = state.mtp.passes if state is not None else []
    strategy = state.strategy if state is not None else None
    return figure_caption(strategy_choice) + figures.animated_html(figures.passes_figure(records, strategy))


def mtp_title(label: str | None) -> str:
    return f"MTP decoding: {label}" if label else "MTP decoding"


# ---------------------------------------------------------------------------- turn -> component updates
def outputs_of(**values: Any) -> tuple:
    """A tuple in :data:`TURN_OUTPUTS` order: the given values, ``gr.skip()`` for the others."""
    unknown = set(values) - set(TURN_OUTPUTS)
    assert not unknown, unknown
    return tuple(values.get(name, gr.skip()) for name in TURN_OUTPUTS)


def idle_outputs(history: list[dict], status: str = "", *, kind: str = "info", notice: str = "",
                 strategy_choice: str = "ConfAdapt") -> tuple:
    """Outputs of a page with ``history`` and no turn running (the start, Clear); the trade-off figure and the
    message box are left as they are."""
    return outputs_of(
        history=history,
        chat_std=render.pane_html(history, None, None, side="standard", title=STD_TITLE),
        chat_mtp=render.pane_html(history, None, None, side="mtp", title=mtp_title(None)),
        stats_std=render.counters_html(None, side="standard", label="standard", state="waiting"),
        stats_mtp=render.counters_html(None, side="mtp", label="MTP", state="waiting"),
        speed="", coloured=render.figure1_html([]), figure=figure_html(None, strategy_choice),
        race=figures.race_figure([]), table=render.pass_table_html(None),
        status=render.status_html(status, kind=kind) if status else "", notice=notice,
        result=render.summary(None, status=status, kind=kind),
    )


def turn_outputs(state: TurnState, *, figures_due: bool, first: bool = False) -> tuple:
    """Component updates for a runner state (figures only when due; the message box cleared once; the
    trade-off figure is the session's, drawn by the caller)."""
    if state.phase == "cleared":
        text, _ = render.turn_status(state)
        return idle_outputs([], text, strategy_choice=choice_of(state.strategy))
    final = state.final
    turn, label = state.turn, state.strategy.label
    side_state = {"running": "running", "done": "done", "stopped": "stopped", "error": "error"}[state.phase]
    std_state = "done" if state.standard_done else side_state
    mtp_state = "done" if state.mtp_done else side_state
    if final:
        history = history_after(state)
        panes = (render.pane_html(history, None, None, side="standard", title=STD_TITLE),
                 render.pane_html(history, None, None, side="mtp", title=mtp_title(label)))
    else:
        history = gr.skip()
        panes = (render.pane_html(turn.history, turn.message, state.standard.text, side="standard", title=STD_TITLE,
                                  running=not state.standard_done),
                 render.pane_html(turn.history, turn.message, state.mtp.text, side="mtp", title=mtp_title(label),
                                  running=not state.mtp_done))
    status, kind = render.turn_status(state)
    draw = figures_due or final
    failed_early = state.phase == "error" and not state.standard.passes and not state.mtp.passes
    sp = state.speed
    return outputs_of(
        message=turn.message if failed_early else ("" if first else gr.skip()),  # a message is never lost
        history=history, chat_std=panes[0], chat_mtp=panes[1],
        stats_std=render.counters_html(state.standard, side="standard", label="standard", state=std_state,
                                       timing=sp.standard if sp else None),
        stats_mtp=render.counters_html(state.mtp, side="mtp", label=label, state=mtp_state,
                                       timing=sp.mtp if sp else None, verifies=state.strategy.verifies),
        speed=render.speed_html(state),  # with the counters, in the same update: the headline never lags them
        coloured=render.figure1_html(state.mtp.passes, state.strategy) if draw else gr.skip(),
        figure=figure_html(state, choice_of(state.strategy)) if draw else gr.skip(),
        race=figures.race_figure([("standard", state.standard.passes), (label, state.mtp.passes)])
        if draw else gr.skip(),
        table=render.pass_table_html(state) if final else gr.skip(),
        status=render.status_html(status, kind=kind) if (first or final) else gr.skip(),
        notice="" if (first or final) else gr.skip(),
        result=render.summary(state, status=status, kind=kind) if final else gr.skip(),
    )


def notice_html(text: str) -> str:
    """An in-page notice under the message box (never a toast over the controls); ``data-at`` (the time)
    makes a repeated notice a new one."""
    return f'<div class="mtp-notice" role="status" data-at="{time.time():.3f}">⏳ {render.esc(text)}</div>'


def refused_outputs(text: str) -> tuple:
    """Only the notice changes (the message stays in the box)."""
    return outputs_of(notice=notice_html(text), result={"phase": "refused", "status": text})


def error_outputs(text: str) -> tuple:
    """A request refused before it ran: the status line says why (in the page, no toast); the message stays
    in the box."""
    return outputs_of(status=render.status_html(text, kind="error"), notice="",
                      result={"phase": "error", "status": text})


def plain_outputs(updates: Iterator[tuple], initial: dict) -> tuple:
    """The last value of every output over a run of updates (``gr.skip()`` keeps the value before), starting
    from ``initial``: what an API client gets instead of Gradio's update dicts."""
    values = dict(initial)
    for out in updates:
        for name, value in zip(TURN_OUTPUTS, out):
            if isinstance(value, dict) and value.get("__type__") == "update":
                if "value" in value:
                    values[name] = value["value"]
                continue
            values[name] = value
    return tuple(values[name] for name in TURN_OUTPUTS)


def _limit(k_max: Any, default: int) -> int:
    """The k_max box as the lossless limit (its default when empty or not a whole number in range)."""
    try:
        k = int(float(k_max))
    except (TypeError, ValueError):
        return default
    return k if 1 <= k <= APP_MAX_K_MAX and k == float(k_max) else default


# ---------------------------------------------------------------------------- the app
def build_app(registry: ModelRegistry | None = None, *, preload: bool = True,
              sessions: SessionRuns | None = None) -> gr.Blocks:
    """Build the Gradio Blocks page.

    Args:
        registry: where models are loaded and cached (a fresh :class:`ModelRegistry` by default).
        preload: load the default model now, and measure its width profile (so the first answer does not
            wait for either, and the page can say what this device does to MTP's speed before it).
        sessions: the one-run-per-session guard (a fresh :class:`SessionRuns` by default).

    Returns:
        The ``gr.Blocks``; ``demo.mtp_registry`` is the registry, ``demo.mtp_sessions`` the sessions.
        Launch it with :func:`launch`.
    """
    registry = registry or ModelRegistry()
    sessions = sessions or SessionRuns()
    facts = registry.facts
    zero_gpu = bool(spaces.config.Config.zero_gpu)
    gr.set_static_paths([str(figures.PLOTLY_JS)])
    default_key = ModelRegistry.key(DEFAULT_SOURCE, "none")
    examples = load_examples()
    default_info = ""
    default_k_max = min(DEFAULT_K_MAX, APP_MAX_K_MAX)
    if preload:
        try:
            default_lm = registry.get(*default_key)
            default_info = render.model_html(default_lm)
            default_k_max = min(default_lm.default_k_max, APP_MAX_K_MAX)
            if not zero_gpu:  # on ZeroGPU the GPU exists only inside a turn: measured there on first use
                facts.profile(default_key, default_lm)
        except RequestError as e:
            default_info = render.status_html(str(e), kind="error")

    # ------------------------------------------------------------ what the model trades here
    def loaded(key: Any) -> Any:
        """The loaded model of ``key`` if it is loaded (never loads one)."""
        key = tuple(key or default_key)
        return registry.get(*key) if key in registry.loaded() else None

    def shape_line(key: Any, k_max_value: Any, shape_choice: Any) -> str:
        key = tuple(key or default_key)
        lm = loaded(key)
        if lm is None:
            return ""
        limit = _limit(k_max_value, min(lm.default_k_max, APP_MAX_K_MAX))
        choice = str(shape_choice or "fastest here")
        shape = facts.shape(key, lm, limit, measure=False) if choice == "fastest here" else None
        return render.shape_text(shape, facts.profile(key), choice, limit, facts.profile_error(key))

    def help_html(choice: Any, key: Any, k_max_value: Any, shape_choice: Any) -> str:
        line = shape_line(key, k_max_value, shape_choice) if choice == "lossless" else ""
        return render.strategy_help_html(str(choice or "ConfAdapt"), line)

    def fastest(key: Any) -> Any:
        """The fastest lossless shape for the model's own k_max (the device note's offer), or None."""
        key = tuple(key or default_key)
        lm = loaded(key)
        return None if lm is None else facts.shape(key, lm, min(lm.default_k_max, APP_MAX_K_MAX), measure=False)

    def device_outputs(key: Any) -> tuple:
        """(device note, its button)."""
        key = tuple(key or default_key)
        prof, best = facts.profile(key), fastest(key)
        note = render.device_note_html(prof, best)
        k = best.k_max if best is not None else 1
        return note, gr.update(visible=bool(note), value=f"Use the fastest lossless setting here (k_max {k})")

    def tradeoff_fig(key: Any, tau_value: Any, k_max_value: Any, choice: Any, session: str | None):
        key = tuple(key or default_key)
        sweep, source = facts.sweep(key, loaded(key))
        k = _limit(k_max_value, None)  # type: ignore[arg-type]
        return figures.tradeoff_figure(sweep, tau=tau_value if choice == "ConfAdapt" else None, k_max=k,
                                       answers=sessions.points(session, key), source=source)

    def measure_visible(key: Any) -> Any:
        key = tuple(key or default_key)
        return gr.update(visible=facts.sweep(key, loaded(key))[0] is None)

    initial_device = device_outputs(default_key) if preload else ("", gr.update(visible=False))

    # ------------------------------------------------------------ a turn
    def generate_turn(message, history, strategy, tau, k_max, k, max_new_tokens, model_key, run_id, shape=None,
                      stream=True) -> Iterator[tuple]:
        """The turn itself: prepare, run both sides, render. Yields ``(outputs, final, history after, extra)``
        (the history with this turn's partial answers while it runs; None when the turn could not start)
        where ``extra`` carries plain values for the main process: the finished answer's trade-off point and the
        model's width profile (measured here on first use on ZeroGPU). ``stream=False`` (API clients, who get the
        last outputs only) renders the first and the final state only.

        On a ZeroGPU Space this runs in a GPU worker (a fork of this process): its arguments and yields
        are pickled (plain values only), and Stop / Clear reach it through the run's stop flag file
        (:func:`app.runner.stop_requested`), polled before every forward pass."""
        try:
            turn = prepare_turn(registry, message, history, strategy, tau, k_max, k, max_new_tokens,
                                model_key or default_key, shape)
        except RequestError as e:
            yield error_outputs(str(e)), True, None, {}
            return
        except Exception as e:  # noqa: BLE001 - never a traceback in the page
            log.exception("preparing a turn failed")
            yield error_outputs(f"Could not start this turn: {type(e).__name__}: {e}"), True, None, {}
            return
        last_pane = last_fig = -1e9
        fig_every = FIGURE_EVERY_S
        first = True
        for state in run_turn(turn, lambda: stop_requested(run_id)):
            now = time.perf_counter()
            if not (first or state.final or (stream and now - last_pane >= PANE_EVERY_S)):
                continue
            due = now - last_fig >= fig_every
            with exclusive():  # no forward pass of any session runs while this renders
                out = turn_outputs(state, figures_due=due, first=first)
            last_pane, first = now, False
            if due:  # the figures grow with the answer: rendering takes at most a quarter of the time
                last_fig = now
                fig_every = max(FIGURE_EVERY_S, 3 * (time.perf_counter() - now))
            extra = {}
            if state.final:
                prof = facts.profile(turn.model_key)
                extra = {"point": answer_point(state), "profile": prof.to_dict() if prof else None}
            yield out, state.final, history_after(state), extra

    if zero_gpu:  # a GPU for this turn only, requested for about as long as it can take
        generate_turn = spaces.GPU(duration=gpu_seconds)(generate_turn)

    def chat(message, history, strategy, tau, k_max, k, max_new_tokens, shape, model_key,
             request: gr.Request = None, stream: bool = True) -> Iterator[tuple]:
        session = getattr(request, "session_hash", None)
        ticket = sessions.begin(session, wait_for_stop=STOP_GRACE_S)
        if ticket is None:
            running = sessions.current(session)
            n = f" (turn {running.turn_number})" if running is not None and running.turn_number else ""
            text = (f"Still answering your previous message{n}: one answer at a time per session. Your new message "
                    "stays in the box; send it when the answer is done, or press Stop first.")
            yield refused_outputs(text)
            return
        with ticket:
            try:
                sent = parse_history(history)
            except RequestError as e:
                yield error_outputs(str(e))
                return
            conversation = sessions.conversation(session, sent)  # a turn stopped just before still counts
            ticket.turn_number = sum(1 for m in conversation if m["role"] == "user") + 1
            key = tuple(model_key or default_key)
            for out, final, after, extra in generate_turn(message, conversation, strategy, tau, k_max, k,
                                                          max_new_tokens, key, ticket.run_id, shape, stream):
                if after is not None:  # recorded when the run ends, however it ends: the next turn continues it
                    ticket.record(after)
                if final:
                    if extra.get("profile") and facts.profile(key) is None:
                        facts.put_profile(key, WidthProfile.from_dict(extra["profile"]))
                    if extra.get("point"):
                        sessions.add_point(session, extra["point"])
                    out = list(out)
                    out[TURN_OUTPUTS.index("tradeoff")] = tradeoff_fig(key, tau, k_max, strategy, session)
                    out = tuple(out)
                if not final and ticket.stop_reason() is not None:
                    continue  # Stop / Clear already answered the page: a late running update must not undo it
                yield out

    def chat_api(message: str, history: list, strategy: str, tau: float, k_max: int, k: int,
                 max_new_tokens: int, shape: str, model_key: Any, request: gr.Request = None) -> tuple:
        """/chat for API clients: the turn run to its end; every output a plain value."""
        start = {name: None for name in TURN_OUTPUTS}
        start.update(message=message, history=history if isinstance(history, list) else [], notice="", status="",
                     speed="", table="")
        return plain_outputs(chat(message, history, strategy, tau, k_max, k, max_new_tokens, shape, model_key,
                                  request, stream=False), start)

    def stop(request: gr.Request = None):
        if sessions.request_stop(getattr(request, "session_hash", None), "stopped"):
            return gr.skip()  # the run ends before its next pass and says so itself
        return notice_html("Nothing is running.")

    def clear(strategy_choice, request: gr.Request = None):
        session = getattr(request, "session_hash", None)
        sessions.request_stop(session, "cleared")
        sessions.remember(session, [])
        return idle_outputs([], "Cleared: a new conversation starts with your next message.",
                            strategy_choice=strategy_choice)[1:]

    def on_strategy(choice, key, k_max_value, shape_choice, tau_value, request: gr.Request = None):
        session = getattr(request, "session_hash", None)
        return (gr.update(visible=choice == "ConfAdapt"), gr.update(visible=choice in ("ConfAdapt", "lossless")),
                gr.update(visible=choice == "static k"), gr.update(visible=choice == "lossless"),
                help_html(choice, key, k_max_value, shape_choice),
                tradeoff_fig(key, tau_value, k_max_value, choice, session))

    def on_controls(choice, key, k_max_value, shape_choice, tau_value, request: gr.Request = None):
        """tau, k_max or the shape changed: the shape line and the trade-off figure (cheap: no model call)."""
        session = getattr(request, "session_hash", None)
        return (help_html(choice, key, k_max_value, shape_choice),
                tradeoff_fig(key, tau_value, k_max_value, choice, session))

    def on_tau(choice, key, k_max_value, tau_value, request: gr.Request = None):
        """The tau slider moved: only the trade-off figure's marker is redrawn."""
        return tradeoff_fig(key, tau_value, k_max_value, choice, getattr(request, "session_hash", None))

    def use_fastest(key):
        best = fastest(key)
        k = best.k_max if best is not None else 1
        return "lossless", k, "fastest here"

    # ------------------------------------------------------------ models
    def load(choice, local_path, quantization, precision):
        """(key, model) or a RequestError. Measures the width profile of a newly loaded model."""
        source = parse_source(choice, local_path)
        key = ModelRegistry.key(source, quantization, precision)
        lm = registry.get(*key)
        if not zero_gpu:
            facts.profile(key, lm)
        return key, lm

    def load_model(choice, local_path, quantization, precision, model_key, strategy_choice, shape_choice, tau_value,
                   request: gr.Request = None):
        session = getattr(request, "session_hash", None)
        try:
            key, lm = load(choice, local_path, quantization, precision)
        except RequestError as e:
            current = (model_key or default_key)[0]
            text = f"{e} Still using {current}."
            return (model_key, gr.skip(), render.status_html(text, kind="error"), gr.skip(), gr.skip(), gr.skip(),
                    gr.skip(), gr.skip(), gr.skip())
        k = min(lm.default_k_max, APP_MAX_K_MAX)
        note, button = device_outputs(key)
        return (key, render.model_html(lm, key[1]), render.status_html(f"Loaded {key[0]}."), k, note, button,
                help_html(strategy_choice, key, k, shape_choice), tradeoff_fig(key, tau_value, k, strategy_choice,
                                                                               session),
                measure_visible(key))

    def load_model_api(choice: str, local_path: str, quantization: str, precision: str, model_key: Any) -> tuple:
        """/load_model for API clients: (model key, model info, status, k_max), every output a plain value."""
        try:
            key, lm = load(choice, local_path, quantization, precision)
            return key, render.model_html(lm, key[1]), render.status_html(f"Loaded {key[0]}."), \
                min(lm.default_k_max, APP_MAX_K_MAX)
        except RequestError as e:
            key = tuple(model_key or default_key)
            text = f"{e} Still using {key[0]}."
            lm = loaded(key)
            info = render.model_html(lm, key[1]) if lm is not None else ""
            k = min(lm.default_k_max, APP_MAX_K_MAX) if lm is not None else default_k_max
            return key, info, render.status_html(text, kind="error"), k

    # ------------------------------------------------------------ the trade-off
    def sweep_gpu(model_key) -> Iterator[tuple]:
        """Measure the trade-off (the GPU part): yields ``("progress", (done, total))``, then ``("result", sweep)``
        or ``("error", message)``; plain values only (a ZeroGPU worker pickles them)."""
        key = tuple(model_key or default_key)
        try:
            lm = registry.get(*key)
        except RequestError as e:
            yield "error", str(e)
            return
        for kind, value in progress_of(lambda cb: facts.measure_sweep(key, lm, examples, on_progress=cb)):
            if kind == "error":
                log.error("measuring the trade-off failed: %r", value)
                value = f"{type(value).__name__}: {value}"
            yield kind, value

    if zero_gpu:
        sweep_gpu = spaces.GPU(duration=GPU_SWEEP_SECONDS)(sweep_gpu)

    def measure(model_key, tau_value, k_max_value, strategy_choice, shape_choice, request: gr.Request = None,
                progress=gr.Progress()):
        key = tuple(model_key or default_key)
        session = getattr(request, "session_hash", None)
        progress(0.0, desc="measuring the trade-off")
        t0 = time.perf_counter()
        for kind, value in sweep_gpu(key):
            if kind == "progress":
                done, total = value
                progress(done / max(total, 1), desc=f"{done} of {total} answers")
            elif kind == "result":
                facts.put_sweep(key, value)
                text = (f"Measured the trade-off on {value.get('n_prompts')} example prompts "
                        f"({value.get('max_new_tokens')} tokens each) in {time.perf_counter() - t0:.0f} s.")
                note, button = device_outputs(key)
                return (tradeoff_fig(key, tau_value, k_max_value, strategy_choice, session),
                        render.status_html(text), measure_visible(key),
                        help_html(strategy_choice, key, k_max_value, shape_choice), note, button)
            else:
                return (gr.skip(), render.status_html(f"Measuring the trade-off failed: {value}", kind="error"),
                        gr.skip(), gr.skip(), gr.skip(), gr.skip())
        return (gr.skip(), render.status_html("Measuring the trade-off ended without a result.", kind="error"),
                gr.skip(), gr.skip(), gr.skip(), gr.skip())

    # ------------------------------------------------------------ layout
    with gr.Blocks(title="MTP Lens", fill_width=True, analytics_enabled=False) as demo:
        gr.HTML(header_html(), js_on_load=None)
        model_info = gr.HTML(default_info, elem_id="model-info", js_on_load=None)
        model_key = gr.State(default_key)
        with gr.Row(elem_id="ask-row"):
            message = gr.Textbox(placeholder="Ask something (Enter sends)",
                                 show_label=False, scale=8, min_width=220, elem_id="message", lines=1, max_lines=6)
            send = gr.Button("Send", variant="primary", scale=1, min_width=64, elem_id="send")
            stop_btn = gr.Button("Stop", variant="stop", scale=1, min_width=64, elem_id="stop")
            clear_btn = gr.Button("Clear", scale=1, min_width=64, elem_id="clear")
        notice = gr.HTML("", elem_id="notice", js_on_load=None)
        status = gr.HTML("", elem_id="status", js_on_load=None)
        with gr.Row(elem_id="controls"):
            strategy = gr.Radio(list(STRATEGY_CHOICES), value="ConfAdapt", label="MTP strategy (right pane)",
                                elem_id="strategy", scale=3, min_width=240)
            tau = threshold_slider(value=DEFAULT_TAU, label="tau (0 to 1)", elem_id="tau", min_width=160,
                             scale=2, info="ConfAdapt threshold")
            k_max = gr.Number(default_k_max, label=f"k_max (1 to {APP_MAX_K_MAX})", elem_id="k-max", min_width=100,
                              scale=1, info="proposals per pass (lossless: the upper bound)")
            k = gr.Number(DEFAULT_STATIC_K, label=f"k (1 to {APP_MAX_K_MAX})", elem_id="k", min_width=100, scale=1,
                          info="tokens per pass", visible=False)
            shape = gr.Radio(list(SHAPE_CHOICES), value="fastest here", label="lossless shape", elem_id="shape",
                             scale=2, min_width=200, visible=False)
            max_new = gr.Number(DEFAULT_MAX_NEW_TOKENS, label=f"max new tokens (1 to {APP_MAX_NEW_TOKENS})",
                                elem_id="max-new-tokens", min_width=120, scale=1, info="per answer")
        strategy_help = gr.HTML(render.strategy_help_html("ConfAdapt"), elem_id="strategy-help", js_on_load=None)
        with gr.Row(elem_id="device-row", equal_height=False):  # on a phone the button goes under the note
            with gr.Column(scale=5, min_width=300):
                device_note = gr.HTML(initial_device[0], elem_id="device-note", js_on_load=None)
            with gr.Column(scale=1, min_width=220):
                fastest_btn = gr.Button(**_button_args(initial_device[1]), size="sm", elem_id="use-fastest")
        gr.Examples(examples=[[p] for p in examples], inputs=[message], label="Example prompts",
                    elem_id="examples")
        with gr.Row(equal_height=False):
            with gr.Column(min_width=280):
                chat_std = gr.HTML(render.pane_html([], None, None, side="standard", title=STD_TITLE),
                                   elem_id="chat-standard", js_on_load=None)
                stats_std = gr.HTML(render.counters_html(None, side="standard", label="standard", state="waiting"),
                                    elem_id="stats-standard", js_on_load=None)
            with gr.Column(min_width=280):
                chat_mtp = gr.HTML(render.pane_html([], None, None, side="mtp", title=mtp_title(None)),
                                   elem_id="chat-mtp", js_on_load=None)
                stats_mtp = gr.HTML(render.counters_html(None, side="mtp", label="MTP", state="waiting"),
                                    elem_id="stats-mtp", js_on_load=None)
        gr.HTML(f'<p class="mtp-caption">{render.esc(LIKE_WITH_LIKE)}</p>' + render.counters_caption(),
                js_on_load=None)
        speed = gr.HTML("", elem_id="speedup", js_on_load=None)
        gr.HTML(render.timing_html(), elem_id="timing-help", js_on_load=None)
        coloured = gr.HTML(render.figure1_html([]), elem_id="coloured-answer", js_on_load=None,
                           label="MTP answer, one colour per forward pass")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=300):
                fig_html = gr.HTML(figure_html(None), elem_id="passes-figure", js_on_load=None)
            with gr.Column(scale=2, min_width=300):
                race = gr.Plot(figures.race_figure([]), show_label=False, elem_id="race")
        with gr.Accordion("Speed vs quality: the trade-off over tau", open=True, elem_id="tradeoff-accordion"):
            sweep0 = facts.sweep(default_key, loaded(default_key)) if preload else (None, None)
            tradeoff = gr.Plot(figures.tradeoff_figure(sweep0[0], tau=DEFAULT_TAU, k_max=default_k_max,
                                                       source=sweep0[1]),
                               show_label=False, elem_id="tradeoff")
            with gr.Row(equal_height=False):
                with gr.Column(scale=1, min_width=200):
                    measure_btn = gr.Button("Measure the trade-off", elem_id="measure-tradeoff", size="sm",
                                            visible=sweep0[0] is None)
                with gr.Column(scale=4, min_width=300):
                    what = ("the share of answers identical to standard decoding's and their likelihood under the "
                            "model.")
                    measure_status = gr.HTML(
                        '<div class="mtp-measure-status">'
                        + (f"From the checkpoint's own sweep ({sweep0[0].get('n_prompts')} prompts, "
                           f"{sweep0[0].get('max_new_tokens')} tokens each): {what}" if sweep0[0] is not None else
                           "Measures ConfAdapt at tau " + ", ".join(f"{t:g}" for t in SWEEP_TAUS)
                           + f" and lossless on the {len(examples)} example prompts, {SWEEP_MAX_NEW_TOKENS} tokens "
                           f"each: {what}")
                        + "</div>", elem_id="measure-status", js_on_load=None)
        with gr.Accordion("Per-pass timing", open=False, elem_id="pass-table-accordion"):
            table = gr.HTML(render.pass_table_html(None), elem_id="pass-table", js_on_load=None)
        with gr.Accordion("Model", open=False, elem_id="model-accordion"):
            with gr.Row():
                model_choice = gr.Dropdown(MODEL_CHOICES, value=DEFAULT_SOURCE, label="Model", scale=3,
                                           allow_custom_value=True, elem_id="model-choice", min_width=280,
                                           info="then press Load model; hub checkpoints need a GPU and network")
                local_path = gr.Textbox(label="…or a local path / hub id", placeholder="/path/to/model or owner/name",
                                        scale=3, elem_id="local-path", min_width=280)
                quantization = gr.Radio(list(QUANTIZATIONS), value="none", label="Quantization (CUDA only)", scale=2)
                precision = gr.Radio(list(PRECISIONS), value="auto", label="Precision", scale=2, elem_id="precision",
                                     info="auto: bf16 where the hardware computes it natively; float32: lossless "
                                          "answers identical to the bit")
                load_btn = gr.Button("Load model", scale=1, elem_id="load-model")
        history = gr.JSON([], visible="hidden", elem_id="history")  # in the page (hidden): tests read it
        result = gr.JSON(None, visible=False, elem_id="result")
        api_chat_btn = gr.Button(visible=False, elem_id="api-chat")
        api_load_btn = gr.Button(visible=False, elem_id="api-load")
        with gr.Column(visible=False, elem_id="api-components"):
            # The API's own components, never shown: free-form inputs that take the README's vocabulary (the
            # page's radio buttons and slider refuse values outside their choices before the app can check them)
            # and outputs labelled with their names (view_api() names outputs by label: value_5, ... without).
            api_chat_inputs = [
                gr.Textbox(label="message"), gr.JSON([], label="history"), gr.Textbox("ConfAdapt", label="strategy"),
                gr.Number(DEFAULT_TAU, label="tau"), gr.Number(default_k_max, label="k_max"),
                gr.Number(DEFAULT_STATIC_K, label="k"), gr.Number(DEFAULT_MAX_NEW_TOKENS, label="max_new_tokens"),
                gr.Textbox("fastest here", label="shape"), model_key]
            api_chat_outputs = [api_output(name) for name in TURN_OUTPUTS]
            api_load_inputs = [gr.Textbox(DEFAULT_SOURCE, label="choice"), gr.Textbox("", label="local_path"),
                               gr.Textbox("none", label="quantization"), gr.Textbox("auto", label="precision"),
                               model_key]
            api_load_outputs = [model_key, gr.HTML(label="model_info"), gr.HTML(label="status"),
                                gr.Number(label="k_max")]

        outputs = [message, history, chat_std, chat_mtp, stats_std, stats_mtp, speed, coloured, fig_html, race,
                   table, status, notice, tradeoff, result]
        assert len(outputs) == len(TURN_OUTPUTS)
        turn_inputs = [message, history, strategy, tau, k_max, k, max_new, shape, model_key]
        gr.on([send.click, message.submit], chat, turn_inputs, outputs, api_name=False, trigger_mode="multiple",
              concurrency_limit=CONCURRENCY, concurrency_id="generate", show_progress="hidden")
        api_chat_btn.click(chat_api, api_chat_inputs, api_chat_outputs, api_name="chat", concurrency_limit=CONCURRENCY,
                           concurrency_id="generate", show_progress="hidden")
        stop_btn.click(stop, None, notice, api_name=False, queue=False, show_progress="hidden")
        clear_btn.click(clear, strategy, outputs[1:], api_name=False, queue=False, show_progress="hidden")
        control_inputs = [strategy, model_key, k_max, shape, tau]
        strategy.change(on_strategy, control_inputs, [tau, k_max, k, shape, strategy_help, tradeoff], api_name=False,
                        queue=False, show_progress="hidden")
        for box in (k_max, shape):
            box.change(on_controls, control_inputs, [strategy_help, tradeoff], api_name=False, queue=False,
                       show_progress="hidden")
        tau.change(on_tau, [strategy, model_key, k_max, tau], tradeoff, api_name=False, queue=False,
                   show_progress="hidden")
        fastest_btn.click(use_fastest, model_key, [strategy, k_max, shape], api_name=False, queue=False,
                          show_progress="hidden")
        measure_btn.click(measure, [model_key, tau, k_max, strategy, shape],
                          [tradeoff, measure_status, measure_btn, strategy_help, device_note, fastest_btn],
                          api_name=False, concurrency_limit=1, concurrency_id="measure", show_progress="full")
        load_btn.click(load_model, [model_choice, local_path, quantization, precision, model_key, strategy, shape, tau],
                       [model_key, model_info, status, k_max, device_note, fastest_btn, strategy_help, tradeoff,
                        measure_btn], api_name=False, concurrency_limit=1)
        api_load_btn.click(load_model_api, api_load_inputs, api_load_outputs, api_name="load_model",
                           concurrency_limit=1)
    demo.mtp_registry = registry  # type: ignore[attr-defined]
    demo.mtp_sessions = sessions  # type: ignore[attr-defined]
    return demo


def threshold_slider(**kwargs: Any) -> gr.Slider:
    """The tau control: Gradio's slider over [0, 1] (step 0.01, arrow keys step by it) with its number box beside
    it, whose value reaches the app unchecked. Gradio's own check would raise a number typed past an end as a toast
    over the controls, on every ``change`` of the box; the slider itself comes back to its range, and a value
    outside it (an API client's) is refused by :func:`app.runner.app_strategy` in the status line, naming the rule
    and the value. (An instance attribute, not a subclass: Gradio writes a ``.pyi`` file beside the module of
    every Component subclass.)"""
    slider = gr.Slider(0, 1, step=0.01, **kwargs)
    slider.preprocess = lambda payload: payload  # type: ignore[method-assign]
    return slider


def api_output(name: str) -> gr.components.Component:
    """A hidden output of the /chat API named ``name`` (one of :data:`TURN_OUTPUTS`), of the kind its value is."""
    if name == "message":
        return gr.Textbox(label=name)
    if name in ("history", "result"):
        return gr.JSON(label=name)
    if name in ("race", "tradeoff"):
        return gr.Plot(label=name)
    return gr.HTML(label=name)


def _button_args(update: Any) -> dict:
    """``gr.Button`` keyword arguments from a ``gr.update`` (value, visible)."""
    d = dict(update) if isinstance(update, dict) else {}
    return {"value": d.get("value", "Use the fastest lossless setting here"), "visible": d.get("visible", False)}


def launch(demo: gr.Blocks, **kwargs: Any) -> Any:
    """Launch ``demo`` with the page's CSS (Gradio 6 takes css at launch). Extra kwargs go to
    ``gr.Blocks.launch`` (server_name, server_port, prevent_thread_lock, ...)."""
    kwargs.setdefault("css", CSS)
    kwargs.setdefault("head", HEAD)
    kwargs.setdefault("footer_links", ["api", "gradio"])
    return demo.queue(default_concurrency_limit=CONCURRENCY).launch(**kwargs)


__all__ = ["build_app", "launch", "TURN_OUTPUTS"]
