"""The Gradio page: its layout and the wiring of its events to :class:`app.page.Page` (paper arXiv 2602.06019,
sections 3.4 and 4.5).

Every user turn is answered by standard decoding (left) and by the chosen MTP strategy (right: ConfAdapt, static
k or lossless verification), both on the same conversation. What each event does lives in :mod:`app.page`; this
module only builds components and connects them. The style is ``assets/app.css``.

API clients (``gradio_client``) and MCP clients get plain values: ``/chat``, ``/chat_summary`` and ``/load_model``
are events of their own whose outputs are complete values (the page's own events may skip outputs, which a client
would receive as Gradio's raw update dicts), on hidden components of their own: free-form inputs (the README's
vocabulary, which the page's radio buttons would refuse) and outputs labelled with their names (``view_api()``).
The app's MCP tools (``launch(mcp_server=True)``) are ``chat_summary`` (a small JSON result, described by
:meth:`app.page.Page.chat_summary`'s docstring) and ``load_model_api``; ``/chat`` (the page's 15 outputs) is API only.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gradio as gr

from model.engine.loading import DEFAULT_SOURCE
from model.engine.strategies import DEFAULT_STATIC_K, DEFAULT_TAU

from . import figures, headline, pass_table, render, tradeoff
from .device import SHAPE_CHOICES, SWEEP_MAX_NEW_TOKENS, SWEEP_TAUS
from .graph import PlotlyGraph
from .outputs import STD_TITLE, TURN_OUTPUTS, figure_value, mtp_title
from .page import Page
from .registry import ModelRegistry
from .requests import (
    APP_MAX_K_MAX,
    APP_MAX_NEW_TOKENS,
    APP_MAX_TEMPERATURE,
    DEFAULT_MAX_NEW_TOKENS,
    PRECISIONS,
    QUANTIZATIONS,
    STRATEGY_CHOICES,
)
from .scripts import BOX_JS, HEAD, SHOW_LOAD_STATUS_JS, STOP_JS, seq_js
from .sessions import SessionRuns

PAPER_URL = "https://arxiv.org/abs/2602.06019"
#: Model dropdown: the embedded default and the authors' released checkpoint(s) by hub id.
MODEL_CHOICES = [
    ("SmolLM2-135M-Instruct (embedded default)", DEFAULT_SOURCE),
    ("Llama-3.1-8B-Magpie-MTP (authors, hub; GPU)", "jwkirchenbauer/L3-1-8B-Magpie-MTP"),
    ("Qwen3-4B-Instruct-2507-MTP (authors, hub; GPU)", "jwkirchenbauer/Qwen3-4B-Inst-2507-MTP"),
]
#: Sessions generating at once (their passes go through one pass loop, shared where the kernels allow).
CONCURRENCY = int(os.environ.get("MTP_APP_CONCURRENCY", "4"))
#: The page's style sheet.
CSS_FILE = Path(__file__).resolve().parent.parent / "assets" / "app.css"
CSS = CSS_FILE.read_text()
#: Serve ``/chat`` as an MCP tool too (Gradio's MCP server at ``/gradio_api/mcp/sse``); ``MTP_APP_MCP=0`` turns it off.
MCP_SERVER = os.environ.get("MTP_APP_MCP", "1") != "0"
LIKE_WITH_LIKE = ("Both panes answer the same conversation: from turn 2 on, the earlier turns carry the standard "
                  "answer (left) as context, so the two sides always answer the same prompt and their times compare "
                  "like with like.")

def header_html() -> str:
    """The page's title and two sentences on what it shows."""
    return (
        '<div class="mtp-header"><h1>MTP Lens: multi-token prediction, side by side</h1>'
        "<p><b>MTP</b> lets an ordinary language model propose a block of up to k_max tokens in one forward pass "
        "by appending mask tokens (<a href=\"" + PAPER_URL + "\" target=\"_blank\" rel=\"noopener\">Kirchenbauer "
        "et al., <i>Multi-Token Prediction via Self-Distillation</i></a>). <b>ConfAdapt</b> keeps the leading run of "
        "proposals whose confidence is at least tau, counted from the first (the model's ordinary next token), which "
        "it always keeps; <b>lossless</b> verification keeps only proposals the model itself confirms, so its answer equals "
        "standard decoding's (to the bit on our CPU kernels, in bf16 as in float32).</p><p class=\"mtp-wide\">Each message is answered twice: standard decoding on the left, "
        "MTP on the right, their forward passes alternating so that each side is timed on its own (a pass may also "
        "carry other visitors' rows, computed exactly as alone).</p></div>")



# ---------------------------------------------------------------------------- the page
def build_app(registry: ModelRegistry | None = None, *, preload: bool = True,
              sessions: SessionRuns | None = None) -> gr.Blocks:
    """Build the Gradio Blocks page: the layout, wired to a :class:`app.page.Page`.

    Args:
        registry: where models are loaded and cached (a fresh :class:`~app.registry.ModelRegistry` by default).
        preload: load the default model now, and measure its width profile.
        sessions: the sessions' turns (a fresh :class:`~app.sessions.SessionRuns` by default).

    Returns:
        The ``gr.Blocks``; ``demo.mtp_page`` is the :class:`~app.page.Page` (``demo.mtp_registry``,
        ``demo.mtp_sessions`` its registry and sessions). Launch it with :func:`launch`.
    """
    page = Page(registry, sessions, preload=preload)
    gr.set_static_paths([str(figures.PLOTLY_JS)])
    with gr.Blocks(title="MTP Lens", fill_width=True, analytics_enabled=False) as demo:
        c = SimpleNamespace()
        _ask_and_controls(page, c)
        _answers(c)
        _tradeoff_and_model(page, c)
        _api_components(page, c)
        _wire(page, c)
    demo.mtp_page = page  # type: ignore[attr-defined]
    demo.mtp_registry = page.registry  # type: ignore[attr-defined]
    demo.mtp_sessions = page.sessions  # type: ignore[attr-defined]
    return demo


def _ask_and_controls(page: Page, c: SimpleNamespace) -> None:
    """The header, the message box and its buttons, the strategy controls and the device note."""
    gr.HTML(header_html(), js_on_load=None)
    c.model_info = gr.HTML(page.default_info, elem_id="model-info", js_on_load=None)
    c.model_key = gr.State(page.default_key)
    with gr.Row(elem_id="ask-row"):
        c.message = gr.Textbox(label="Your message", placeholder="Ask something (Enter sends)", show_label=False,
                               scale=8, min_width=220, elem_id="message", lines=1, max_lines=6)
        c.send = gr.Button("Send", variant="primary", scale=1, min_width=64, elem_id="send")
        c.stop = gr.Button("Stop", variant="secondary", scale=1, min_width=64, elem_id="stop")  # red only suits a running turn
        c.clear = gr.Button("Clear", scale=1, min_width=64, elem_id="clear")
    c.notice = gr.HTML("", elem_id="notice", js_on_load=None)
    c.status = gr.HTML("", elem_id="status", js_on_load=None)
    with gr.Row(elem_id="controls"):
        c.strategy = gr.Radio(list(STRATEGY_CHOICES), value="ConfAdapt", label="MTP strategy (right pane)",
                              elem_id="strategy", scale=3, min_width=240)
        # shown and hidden through its column: an update of the slider itself would make Gradio rebuild it without
        # unchecked_slider's preprocess (a number past an end then failed the event with a 500 and a traceback)
        with gr.Column(scale=2, min_width=160, elem_id="tau-column") as c.tau_column:
            c.tau = unchecked_slider(0, 1, 0.01, value=DEFAULT_TAU, label="tau (0 to 1)", elem_id="tau",
                                     info="ConfAdapt threshold")
        c.k_max = gr.Number(page.default_k_max, label=f"k_max (1 to {APP_MAX_K_MAX})", elem_id="k-max", min_width=100,
                            scale=1, info="proposals per pass (lossless: the upper bound)")
        c.k = gr.Number(DEFAULT_STATIC_K, label=f"k (1 to {APP_MAX_K_MAX})", elem_id="k", min_width=100, scale=1,
                        info="tokens per pass", visible=False)
        c.shape = gr.Radio(list(SHAPE_CHOICES), value="fastest here", label="lossless shape", elem_id="shape", scale=2,
                           min_width=200, visible=False)
        c.max_new = gr.Number(DEFAULT_MAX_NEW_TOKENS, label=f"max new tokens (1 to {APP_MAX_NEW_TOKENS})",
                              elem_id="max-new-tokens", min_width=120, scale=1, info="per answer")
    with gr.Row(elem_id="sampling-controls"):
        c.temperature = unchecked_slider(0, APP_MAX_TEMPERATURE, 0.05, value=0.0, label="temperature",
                                         elem_id="temperature", min_width=160, scale=2,
                                         info="0 = greedy; above 0 both sides sample")
        c.top_p = unchecked_slider(0.05, 1, 0.01, value=1.0, label="top-p", elem_id="top-p", min_width=160, scale=2,
                                   info="nucleus: keep this much probability (1 = off)")
    c.strategy_help = gr.HTML(render.strategy_help_html("ConfAdapt"), elem_id="strategy-help", js_on_load=None)
    note, button = page.device_outputs(page.default_key) if page.loaded(None) is not None else \
        ("", gr.update(visible=False))
    with gr.Row(elem_id="device-row", equal_height=False):  # on a phone the button goes under the note
        with gr.Column(scale=5, min_width=300):
            c.device_note = gr.HTML(note, elem_id="device-note", js_on_load=None)
        with gr.Column(scale=1, min_width=220):
            c.fastest = gr.Button(**_button_args(button), size="sm", elem_id="use-fastest")
    gr.Examples(examples=[[p] for p in page.examples], inputs=[c.message], label="Example prompts",
                elem_id="examples")


def _answers(c: SimpleNamespace) -> None:
    """The two panes with their counters, the headline, the coloured answer and the pass figures."""
    with gr.Row(equal_height=True, elem_id="answers-row"):  # the counters level, whatever each answer's length
        with gr.Column(min_width=280):
            c.chat_std = gr.HTML(render.pane_html([], None, None, side="standard", title=STD_TITLE),
                                 elem_id="chat-standard", js_on_load=None)
            c.stats_std = gr.HTML(render.counters_html(None, side="standard", label="standard", state="waiting"),
                                  elem_id="stats-standard", js_on_load=None)
        with gr.Column(min_width=280):
            c.chat_mtp = gr.HTML(render.pane_html([], None, None, side="mtp", title=mtp_title(None)),
                                 elem_id="chat-mtp", js_on_load=None)
            c.stats_mtp = gr.HTML(render.counters_html(None, side="mtp", label="MTP", state="waiting"),
                                  elem_id="stats-mtp", js_on_load=None)
    gr.HTML(f'<p class="mtp-caption">{render.esc(LIKE_WITH_LIKE)}</p>' + render.counters_caption(), js_on_load=None)
    c.speed = gr.HTML("", elem_id="speedup", js_on_load=None)
    gr.HTML(headline.timing_html(), elem_id="timing-help", js_on_load=None)
    c.coloured = gr.HTML(render.figure1_html([]), elem_id="coloured-answer", js_on_load=None,
                         label="MTP answer, one colour per forward pass")
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=300):
            c.figure = PlotlyGraph(figure_value(None), elem_id="passes-figure")
        with gr.Column(scale=2, min_width=300):
            c.race = PlotlyGraph(figures.race_figure([]), elem_id="race")


def _tradeoff_and_model(page: Page, c: SimpleNamespace) -> None:
    """The trade-off figure and its Measure button, the per-pass table, the model menu."""
    with gr.Accordion("Speed vs quality: the trade-off over tau", open=True, elem_id="tradeoff-accordion"):
        sweep, source = page.facts.sweep(page.default_key, page.loaded(None))
        c.tradeoff = PlotlyGraph(tradeoff.tradeoff_figure(sweep, tau=DEFAULT_TAU, k_max=page.default_k_max,
                                                          source=source), elem_id="tradeoff")
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=200):
                c.measure = gr.Button("Measure the trade-off", elem_id="measure-tradeoff", size="sm",
                                      visible=sweep is None)
            with gr.Column(scale=4, min_width=300):
                c.measure_status = gr.HTML(_measure_text(sweep, len(page.examples)), elem_id="measure-status",
                                           js_on_load=None)
    with gr.Accordion("Per-pass timing", open=False, elem_id="pass-table-accordion"):
        c.table = gr.HTML(pass_table.pass_table_html(None), elem_id="pass-table", js_on_load=None)
    with gr.Accordion("Model", open=False, elem_id="model-accordion"):
        with gr.Row():
            c.model_choice = gr.Dropdown(MODEL_CHOICES, value=DEFAULT_SOURCE, label="Model", scale=3,
                                         allow_custom_value=True, elem_id="model-choice", min_width=280,
                                         info="then press Load model; hub checkpoints need a GPU and network")
            c.local_path = gr.Textbox(label="…or a local path / hub id", placeholder="/path/to/model or owner/name",
                                      scale=3, elem_id="local-path", min_width=280)
            c.quantization = gr.Radio(list(QUANTIZATIONS), value="none", label="Quantization (CUDA only)", scale=2)
            c.precision = gr.Radio(list(PRECISIONS), value="auto", label="Precision", scale=2, elem_id="precision",
                                   info="auto: bf16 where the hardware computes it natively; float32: lossless "
                                        "answers identical to the bit")
            c.load = gr.Button("Load model", scale=1, elem_id="load-model")
        c.load_status = gr.HTML("", elem_id="load-status", js_on_load=None)  # the outcome, scrolled into view


def _measure_text(sweep: Any, n_examples: int) -> str:
    what = "the share of answers identical to standard decoding's and their likelihood under the model."
    if sweep is not None:
        body = f"From the checkpoint's own sweep ({sweep.n_prompts} prompts, {sweep.max_new_tokens} tokens each): {what}"
    else:
        body = ("Measures ConfAdapt at tau " + ", ".join(f"{t:g}" for t in SWEEP_TAUS) + f" and lossless on the "
                f"{n_examples} example prompts, {SWEEP_MAX_NEW_TOKENS} tokens each: {what}")
    return f'<div class="mtp-measure-status">{body}</div>'


def _api_components(page: Page, c: SimpleNamespace) -> None:
    """Hidden components: the page's state (history, result, the message box's commands) and the API's own."""
    c.history = gr.JSON([], visible="hidden", elem_id="history")  # in the page (hidden): tests read it
    c.result = gr.JSON(None, visible=False, elem_id="result")
    c.box = gr.Textbox("", visible=False, elem_id="box-command")
    c.seq = gr.Textbox("", visible=False, elem_id="message-number")  # the page's number for each message sent
    c.api_chat = gr.Button(visible=False, elem_id="api-chat")
    c.api_load = gr.Button(visible=False, elem_id="api-load")
    c.api_summary = gr.Button(visible=False, elem_id="api-summary")
    with gr.Column(visible=False, elem_id="api-components"):
        # Free-form inputs that take the README's vocabulary (the page's radio buttons and slider refuse values
        # outside their choices before the app can check them), outputs labelled with their names.
        c.api_chat_inputs = [
            gr.Textbox(label="message"), history_input(), gr.Textbox("ConfAdapt", label="strategy"),
            gr.Number(DEFAULT_TAU, label="tau"), gr.Number(page.default_k_max, label="k_max"),
            gr.Number(DEFAULT_STATIC_K, label="k"), gr.Number(DEFAULT_MAX_NEW_TOKENS, label="max_new_tokens"),
            gr.Textbox("fastest here", label="shape"), c.model_key, gr.Number(0.0, label="temperature"),
            gr.Number(1.0, label="top_p")]
        c.api_chat_outputs = [api_output(name) for name in TURN_OUTPUTS]
        c.api_summary_output = gr.Textbox(label="summary")
        c.api_load_inputs = [gr.Textbox(DEFAULT_SOURCE, label="choice"), gr.Textbox("", label="local_path"),
                             gr.Textbox("none", label="quantization"), gr.Textbox("auto", label="precision"),
                             c.model_key]
        c.api_load_outputs = [c.model_key, gr.HTML(label="model_info"), gr.HTML(label="status"),
                              gr.Number(label="k_max")]


def _wire(page: Page, c: SimpleNamespace) -> None:
    """Every event to its :class:`~app.page.Page` method."""
    quiet = dict(api_name=False, queue=False, show_progress="hidden")
    outputs = [c.box, c.history, c.chat_std, c.chat_mtp, c.stats_std, c.stats_mtp, c.speed, c.coloured, c.figure,
               c.race, c.table, c.status, c.notice, c.tradeoff, c.result]
    assert len(outputs) == len(TURN_OUTPUTS)
    turn_inputs = [c.message, c.history, c.strategy, c.tau, c.k_max, c.k, c.max_new, c.shape, c.model_key,
                   c.temperature, c.top_p, c.seq]
    gr.on([c.send.click, c.message.submit], page.chat, turn_inputs, outputs, api_name=False, trigger_mode="multiple",
          concurrency_limit=CONCURRENCY, concurrency_id="generate", show_progress="hidden", js=seq_js(len(turn_inputs)))
    c.box.change(None, [c.box, c.message], c.message, js=BOX_JS, **quiet)
    c.api_chat.click(api_only(page.chat_api), c.api_chat_inputs, c.api_chat_outputs, api_name="chat",
                     concurrency_limit=CONCURRENCY, concurrency_id="generate", show_progress="hidden")
    c.api_summary.click(page.chat_summary, c.api_chat_inputs, c.api_summary_output, api_name="chat_summary",
                        concurrency_limit=CONCURRENCY, concurrency_id="generate", show_progress="hidden")
    c.stop.click(page.stop, c.seq, c.notice, js=STOP_JS, **quiet)
    c.clear.click(page.clear, [c.strategy, c.model_key, c.tau, c.k_max], outputs[1:], **quiet)
    controls = [c.strategy, c.model_key, c.k_max, c.shape, c.tau]
    c.strategy.change(page.on_strategy, controls, [c.tau_column, c.k_max, c.k, c.shape, c.strategy_help, c.tradeoff],
                      **quiet)
    for box in (c.k_max, c.shape):
        box.change(page.on_controls, controls, [c.strategy_help, c.tradeoff], **quiet)
    c.tau.change(page.on_tau, [c.strategy, c.model_key, c.k_max, c.tau], c.tradeoff, **quiet)
    c.fastest.click(page.use_fastest, c.model_key, [c.strategy, c.k_max, c.shape], **quiet)
    c.measure.click(page.measure, [c.model_key, c.tau, c.k_max, c.strategy, c.shape],
                    [c.tradeoff, c.measure_status, c.measure, c.strategy_help, c.device_note, c.fastest],
                    api_name=False, concurrency_limit=1, concurrency_id="measure", show_progress="full")
    c.load.click(_status_beside(page.load_model), [c.model_choice, c.local_path, c.quantization, c.precision,
                                                    c.model_key, c.strategy, c.shape, c.tau],
                 [c.model_key, c.model_info, c.status, c.k_max, c.device_note, c.fastest, c.strategy_help,
                  c.tradeoff, c.measure, c.load_status], api_name=False, concurrency_limit=1
                 ).then(None, js=SHOW_LOAD_STATUS_JS, **quiet)
    c.api_load.click(page.load_model_api, c.api_load_inputs, c.api_load_outputs, api_name="load_model",
                     concurrency_limit=1)


def _status_beside(load_model: Any) -> Any:
    """``Page.load_model`` with its status line (its third output) also under the Load model button: the page's
    status line is at the top, a screen or two above the button, where a load's outcome went unseen."""
    def load(choice, local_path, quantization, precision, model_key, strategy_choice, shape_choice, tau_value,
             request: gr.Request = None):
        out = load_model(choice, local_path, quantization, precision, model_key, strategy_choice, shape_choice,
                         tau_value, request)
        return (*out, out[2])
    return load


def unchecked_slider(lo: float, hi: float, step: float, **kwargs: Any) -> gr.Slider:
    """A control of tau, the temperature or top-p: Gradio's slider over [lo, hi] (arrow keys step by ``step``) with
    its number box beside it, whose value reaches the app unchecked. Gradio's own check would raise a number typed
    past an end as a toast over the controls, on every ``change`` of the box; the slider itself comes back to its
    range, and a value outside it (an API client's) is refused by :mod:`app.requests` in the status line, naming the
    rule and the value. (An instance attribute, not a subclass: Gradio writes a ``.pyi`` file beside the module of
    every Component subclass.) No event may update such a slider (``gr.update``): Gradio would rebuild it for the
    session from its constructor's arguments, without this check's removal; show or hide its container instead."""
    slider = gr.Slider(lo, hi, step=step, **kwargs)
    slider.preprocess = lambda payload: payload  # type: ignore[method-assign]
    return slider


def api_only(fn: Any) -> Any:
    """``fn`` as an API endpoint that is no MCP tool: ``/chat``'s 15 outputs (HTML, Plotly JSON) are the page's,
    far too much for an agent, which gets ``chat_summary`` instead. Gradio lists as tools only functions whose
    ``_mcp_type`` is absent or ``"tool"``."""
    import functools

    @functools.wraps(fn)
    def endpoint(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    endpoint._mcp_type = "api only"  # type: ignore[attr-defined]
    return endpoint


def history_input() -> gr.JSON:
    """The API's history input: a JSON list (of messages, or of ``[user, assistant]`` pairs). Its schema says so
    (Gradio's JSON component states ``{"type": {}}``, which is no JSON schema: an MCP client refuses every call
    with it); the value itself is checked by :func:`app.requests.parse_history`."""
    box = gr.JSON([], label="history")
    box.api_info = lambda: {"type": "array", "items": {}, "description": "the conversation so far"}  # type: ignore
    return box


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
    kwargs.setdefault("mcp_server", MCP_SERVER)
    with warnings.catch_warnings():
        # The MCP tool's one gr.State input is the model key, whose default (the default model) is meant: MCP
        # calls are independent, and the tool's arguments do not include it.
        warnings.filterwarnings("ignore", message="This MCP server includes a tool that has a gr.State input")
        return demo.queue(default_concurrency_limit=CONCURRENCY).launch(**kwargs)


__all__ = ["build_app", "launch", "TURN_OUTPUTS"]
