"""The Gradio page: layout and event wiring only (paper arXiv 2602.06019, sections 3.4 and 4.5).

Every user turn is answered by standard decoding (left) and by the chosen MTP strategy (right:
ConfAdapt, static k or lossless verification), both on the same conversation. A turn is prepared
and run by :mod:`app.runner` (no Gradio there), drawn by :mod:`app.render` (HTML) and
:mod:`app.figures` (Plotly); this module lays out the page and turns runner states into component
updates. Bad input never raises into Gradio: it becomes a message in the page (status line and
toast), and the message box keeps the text.
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

#: Outputs of a turn, in this order (the /chat API returns them in this order too).
TURN_OUTPUTS = ("message", "history", "chat_std", "chat_mtp", "stats_std", "stats_mtp", "speed", "coloured",
                "figure", "race", "table", "status", "notice", "result")

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
.mtp-counter-name {font-size: .78em; color: var(--body-text-color-subdued)}
.mtp-counter-value {font-weight: 600; font-variant-numeric: tabular-nums}
.mtp-caption {font-size: .85em}
.mtp-caption p {margin: .3em 0}
.mtp-speed {padding: 6px 10px; border-left: 4px solid #d62728; background: var(--background-fill-secondary)}
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
        "standard decoding's (to the bit in float32).</p><p class=\"mtp-wide\">Each message is answered twice: standard decoding on the left, "
        "MTP on the right, their forward passes alternating on one worker so that each is timed alone.</p></div>")


def figure_caption(strategy_choice: str) -> str:
    """The legend of the animated figure's colours for a strategy."""
    def sw(colour: str) -> str:
        return f'<span class="mtp-swatch" style="background:{colour}"></span>'
    if strategy_choice == "lossless":
        body = (f"{sw(figures.DRAFT_OK)} ✓ draft accepted (equals the model's own choice) · {sw(figures.DRAFT_BAD)} "
                f"✗ draft rejected · {sw(figures.OWN)} → the model's own token, always kept (its correction, or its "
                f"next token) · {sw(figures.NEW_DRAFT)} new drafts proposed by the masks. Height: the model's confidence at "
                "that place")
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
def idle_outputs(history: list[dict], status: str = "", *, kind: str = "info", notice: str = "",
                 strategy_choice: str = "ConfAdapt") -> tuple:
    """Outputs of a page with ``history`` and no turn running (the start, Clear)."""
    return (
        gr.skip(), history,
        render.pane_html(history, None, None, side="standard", title=STD_TITLE),
        render.pane_html(history, None, None, side="mtp", title=mtp_title(None)),
        render.counters_html(None, side="standard", label="standard", state="waiting"),
        render.counters_html(None, side="mtp", label="MTP", state="waiting"),
        "", render.figure1_html([]), figure_html(None, strategy_choice), figures.race_figure([]),
        render.pass_table_html(None), render.status_html(status, kind=kind) if status else "",
        notice, render.summary(None, status=status, kind=kind),
    )


def turn_outputs(state: TurnState, *, figures_due: bool, first: bool = False) -> tuple:
    """Component updates for a runner state (figures only when due; the message box cleared once)."""
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
    return (
        turn.message if failed_early else ("" if first else gr.skip()),  # a message is never lost
        history,
        *panes,
        render.counters_html(state.standard, side="standard", label="standard", state=std_state),
        render.counters_html(state.mtp, side="mtp", label=label, state=mtp_state),
        render.speed_html(state) if (draw or state.phase != "running") else gr.skip(),
        render.figure1_html(state.mtp.passes, state.strategy) if draw else gr.skip(),
        figure_html(state, choice_of(state.strategy)) if draw else gr.skip(),
        figures.race_figure([("standard", state.standard.passes), (label, state.mtp.passes)]) if draw else gr.skip(),
        render.pass_table_html(state) if final else gr.skip(),
        render.status_html(status, kind=kind) if (first or final) else gr.skip(),
        "" if (first or final) else gr.skip(),
        render.summary(state, status=status, kind=kind) if final else gr.skip(),
    )


def refused_outputs(text: str) -> tuple:
    """Only the notice changes (the message stays in the box)."""
    return (gr.skip(),) * 12 + (f'<div class="mtp-notice" role="status">⏳ {render.esc(text)}</div>',
                                {"phase": "refused", "status": text})


def error_outputs(text: str) -> tuple:
    """A request refused before it ran: status and toast; the message stays in the box."""
    gr.Warning(text)
    return (gr.skip(),) * 11 + (render.status_html(text, kind="error"), "",
                                {"phase": "error", "status": text})


# ---------------------------------------------------------------------------- the app
def build_app(registry: ModelRegistry | None = None, *, preload: bool = True,
              sessions: SessionRuns | None = None) -> gr.Blocks:
    """Build the Gradio Blocks page.

    Args:
        registry: where models are loaded and cached (a fresh :class:`ModelRegistry` by default).
        preload: load the default model now (so the first answer does not wait for it).
        sessions: the one-run-per-session guard (a fresh :class:`SessionRuns` by default).

    Returns:
        The ``gr.Blocks``; ``demo.mtp_registry`` is the registry. Launch it with :func:`launch`.
    """
    registry = registry or ModelRegistry()
    sessions = sessions or SessionRuns()
    gr.set_static_paths([str(figures.PLOTLY_JS)])
    default_key = ModelRegistry.key(DEFAULT_SOURCE, "none")
    default_info = ""
    default_k_max = min(DEFAULT_K_MAX, APP_MAX_K_MAX)
    if preload:
        try:
            default_lm = registry.get(*default_key)
            default_info = render.model_html(default_lm)
            default_k_max = min(default_lm.default_k_max, APP_MAX_K_MAX)
        except RequestError as e:
            default_info = render.status_html(str(e), kind="error")

    def generate_turn(message, history, strategy, tau, k_max, k, max_new_tokens, model_key, run_id
                      ) -> Iterator[tuple]:
        """The turn itself: prepare, run both sides, render. Yields ``(outputs, final, history after)``.

        On a ZeroGPU Space this runs in a GPU worker (a fork of this process): its arguments and yields
        are pickled (plain values only), and Stop / Clear reach it through the run's stop flag file
        (:func:`app.runner.stop_requested`), polled before every forward pass."""
        try:
            turn = prepare_turn(registry, message, history, strategy, tau, k_max, k, max_new_tokens,
                                model_key or default_key)
        except RequestError as e:
            yield error_outputs(str(e)), True, None
            return
        except Exception as e:  # noqa: BLE001 - never a traceback in the page
            log.exception("preparing a turn failed")
            yield error_outputs(f"{type(e).__name__}: {e}"), True, None
            return
        last_pane = last_fig = -1e9
        first = True
        for state in run_turn(turn, lambda: stop_requested(run_id)):
            now = time.perf_counter()
            if not (first or state.final or now - last_pane >= PANE_EVERY_S):
                continue
            due = now - last_fig >= FIGURE_EVERY_S
            with exclusive():  # no forward pass of any session runs while this renders
                out = turn_outputs(state, figures_due=due, first=first)
            if state.phase == "error":
                gr.Warning(state.error or "generation failed")
            last_pane, first = now, False
            if due:
                last_fig = now
            yield out, state.final, history_after(state) if state.final else None

    if spaces.config.Config.zero_gpu:  # a GPU for this turn only, requested for about as long as it can take
        generate_turn = spaces.GPU(duration=gpu_seconds)(generate_turn)

    def chat(message, history, strategy, tau, k_max, k, max_new_tokens, model_key,
             request: gr.Request = None) -> Iterator[tuple]:
        session = getattr(request, "session_hash", None)
        ticket = sessions.begin(session)
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
            for out, final, after in generate_turn(message, conversation, strategy, tau, k_max, k, max_new_tokens,
                                                   model_key, ticket.run_id):
                if final and after is not None:
                    sessions.remember(session, after)
                if not final and ticket.stop_reason() is not None:
                    continue  # Stop / Clear already answered the page: a late running update must not undo it
                yield out

    def stop(request: gr.Request = None):
        if sessions.request_stop(getattr(request, "session_hash", None), "stopped"):
            return gr.skip()  # the run ends before its next pass and says so itself
        return '<div class="mtp-notice" role="status">Nothing is running.</div>'

    def clear(strategy_choice, request: gr.Request = None):
        session = getattr(request, "session_hash", None)
        sessions.request_stop(session, "cleared")
        sessions.remember(session, [])
        return idle_outputs([], "Cleared: a new conversation starts with your next message.",
                            strategy_choice=strategy_choice)[1:]

    def on_strategy(choice):
        return (gr.update(visible=choice == "ConfAdapt"), gr.update(visible=choice in ("ConfAdapt", "lossless")),
                gr.update(visible=choice == "static k"), render.strategy_help_html(choice))

    def load_model(choice, local_path, quantization, precision, model_key):
        try:
            source = parse_source(choice, local_path)
            key = ModelRegistry.key(source, quantization, precision)
            lm = registry.get(*key)
        except RequestError as e:
            current = (model_key or default_key)[0]
            text = f"{e} Still using {current}."
            gr.Warning(text)
            return model_key, gr.skip(), render.status_html(text, kind="error"), gr.skip()
        return (key, render.model_html(lm, key[1]), render.status_html(f"Loaded {key[0]}."),
                min(lm.default_k_max, APP_MAX_K_MAX))

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
            tau = gr.Number(DEFAULT_TAU, label="tau (0 to 1)", elem_id="tau", min_width=100, scale=1,
                            info="ConfAdapt threshold")
            k_max = gr.Number(default_k_max, label=f"k_max (1 to {APP_MAX_K_MAX})", elem_id="k-max", min_width=100,
                              scale=1, info="proposals per pass")
            k = gr.Number(DEFAULT_STATIC_K, label=f"k (1 to {APP_MAX_K_MAX})", elem_id="k", min_width=100, scale=1,
                          info="tokens per pass", visible=False)
            max_new = gr.Number(DEFAULT_MAX_NEW_TOKENS, label=f"max new tokens (1 to {APP_MAX_NEW_TOKENS})",
                                elem_id="max-new-tokens", min_width=120, scale=1, info="per answer")
        strategy_help = gr.HTML(render.strategy_help_html("ConfAdapt"), elem_id="strategy-help", js_on_load=None)
        gr.Examples(examples=[[p] for p in load_examples()], inputs=[message], label="Example prompts",
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
        coloured = gr.HTML(render.figure1_html([]), elem_id="coloured-answer", js_on_load=None,
                           label="MTP answer, one colour per forward pass")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=300):
                fig_html = gr.HTML(figure_html(None), elem_id="passes-figure", js_on_load=None)
            with gr.Column(scale=2, min_width=300):
                race = gr.Plot(figures.race_figure([]), show_label=False, elem_id="race")
        with gr.Accordion("Per-pass timing", open=False, elem_id="pass-table-accordion"):
            table = gr.HTML(render.pass_table_html(None), elem_id="pass-table", js_on_load=None)
        with gr.Accordion("Model", open=False, elem_id="model-accordion"):
            with gr.Row():
                model_choice = gr.Dropdown(MODEL_CHOICES, value=DEFAULT_SOURCE, label="Model", scale=3,
                                           allow_custom_value=True,
                                           info="then press Load model; hub checkpoints need a GPU and network")
                local_path = gr.Textbox(label="…or a local path / hub id", placeholder="/path/to/model or owner/name",
                                        scale=3, elem_id="local-path")
                quantization = gr.Radio(list(QUANTIZATIONS), value="none", label="Quantization (CUDA only)", scale=2)
                precision = gr.Radio(list(PRECISIONS), value="auto", label="Precision", scale=2, elem_id="precision",
                                     info="auto: bf16 where the hardware computes it natively; float32: lossless "
                                          "answers identical to the bit")
                load_btn = gr.Button("Load model", scale=1, elem_id="load-model")
        history = gr.JSON([], visible=False, elem_id="history")
        result = gr.JSON(None, visible=False, elem_id="result")

        outputs = [message, history, chat_std, chat_mtp, stats_std, stats_mtp, speed, coloured, fig_html, race,
                   table, status, notice, result]
        assert len(outputs) == len(TURN_OUTPUTS)
        gr.on([send.click, message.submit], chat, [message, history, strategy, tau, k_max, k, max_new, model_key],
              outputs, api_name="chat", trigger_mode="multiple", concurrency_limit=CONCURRENCY,
              concurrency_id="generate", show_progress="hidden")
        stop_btn.click(stop, None, notice, api_name=False, queue=False, show_progress="hidden")
        clear_btn.click(clear, strategy, outputs[1:], api_name=False, queue=False, show_progress="hidden")
        strategy.change(on_strategy, strategy, [tau, k_max, k, strategy_help], api_name=False, queue=False,
                        show_progress="hidden")
        load_btn.click(load_model, [model_choice, local_path, quantization, precision, model_key],
                       [model_key, model_info, status, k_max], api_name="load_model", concurrency_limit=1)
    demo.mtp_registry = registry  # type: ignore[attr-defined]
    demo.mtp_sessions = sessions  # type: ignore[attr-defined]
    return demo


def launch(demo: gr.Blocks, **kwargs: Any) -> Any:
    """Launch ``demo`` with the page's CSS (Gradio 6 takes css at launch). Extra kwargs go to
    ``gr.Blocks.launch`` (server_name, server_port, prevent_thread_lock, ...)."""
    kwargs.setdefault("css", CSS)
    kwargs.setdefault("head", HEAD)
    kwargs.setdefault("footer_links", ["api", "gradio"])
    return demo.queue(default_concurrency_limit=CONCURRENCY).launch(**kwargs)


__all__ = ["build_app", "launch", "TURN_OUTPUTS"]
