"""The Gradio Blocks page: chat answered twice, side by side (standard | MTP), with the
animated forward-pass figure, the race figure and the coloured answer (paper Fig. 1).

Every user turn is answered by standard decoding (left) and by the chosen MTP strategy
(right: ConfAdapt by default, static k selectable), paper sections 3.4 and 4.5. The two answers
stream together; their forward passes alternate on one worker (see :mod:`app.runner`).
Bad input never raises into Gradio: it becomes a message in the page's status line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import gradio as gr

from model.checkpoint import DEFAULT_SOURCE, LoadedModel

from . import figures
from .runner import (
    APP_MAX_K_MAX,
    ModelRegistry,
    Pane,
    RequestError,
    build_strategy,
    check_max_new_tokens,
    check_message,
    parse_source,
    prompt_ids_for,
    run_side_by_side,
    speedup,
)

log = logging.getLogger(__name__)

PAPER_URL = "https://arxiv.org/abs/2602.06019"
EXAMPLES_FILE = Path(__file__).resolve().parent.parent / "assets" / "examples.json"
#: Model dropdown: the embedded default and the authors' released checkpoint(s) by hub id.
MODEL_CHOICES = [
    ("SmolLM2-135M-Instruct (embedded default)", DEFAULT_SOURCE),
    ("Llama-3.1-8B-Magpie-MTP (authors, hub; GPU)", "jwkirchenbauer/L3-1-8B-Magpie-MTP"),
]
STRATEGIES = ["ConfAdapt", "static k"]
#: Seconds between re-renders of the figures while answers stream (the chat updates every pass).
FIGURE_EVERY_S = float(os.environ.get("MTP_APP_FIGURE_EVERY_S", "0.6"))
#: Sessions generating at once (their forward passes still run one at a time).
CONCURRENCY = int(os.environ.get("MTP_APP_CONCURRENCY", "4"))

CSS = """
#status {min-height: 1.5em}
#status p {margin: 0}
.mtp-stats table {font-size: 0.9em}
"""

try:  # Hugging Face Spaces (ZeroGPU): run generation inside a GPU slot when the package exists.
    import spaces  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - not on Spaces
    spaces = None


def load_examples(path: Path = EXAMPLES_FILE) -> list[str]:
    """Example prompts from ``assets/examples.json`` (a list of ``{"kind", "prompt"}``)."""
    try:
        return [e["prompt"] for e in json.loads(path.read_text())]
    except (OSError, ValueError, KeyError, TypeError):
        return ["What is 12 times 7? Think step by step."]


# ---------------------------------------------------------------------------- rendering
def _plain(content: Any) -> str:
    """Text of a Chatbot message content (str or Gradio 6's list of ``{"type": "text"}`` parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", "") or "")
    if isinstance(content, (list, tuple)):
        return "".join(_plain(c) for c in content)
    return "" if content is None else str(content)


def to_messages(history: Sequence[dict] | None) -> list[dict]:
    """A Chatbot value as plain ``{"role", "content": str}`` messages (for the model)."""
    out = []
    for m in history or []:
        if isinstance(m, dict) and m.get("role") in ("user", "assistant", "system"):
            out.append({"role": m["role"], "content": _plain(m.get("content"))})
    return out


def stats_markdown(pane: Pane | None, label: str) -> str:
    """The counters under a pane: tokens, forward passes, effective k, per-pass and total time,
    tokens/s."""
    if pane is None:
        return f"**{label}** — waiting"
    state = "done" if pane.done else "running…"
    return (
        f"**{label}** · {state}\n\n"
        f"| tokens | forward passes | effective k | total s | prefill ms | ms / pass | tokens/s |\n"
        f"|---:|---:|---:|---:|---:|---:|---:|\n"
        f"| {pane.tokens} | {pane.forward_passes} | {pane.effective_k:.2f} | {pane.seconds:.2f} | "
        f"{pane.prefill_ms:.0f} | {pane.decode_ms_per_pass:.0f} | {pane.tokens_per_second:.1f} |"
    )


def speedup_markdown(std: Pane, mtp: Pane) -> str:
    """One line: the MTP side's wall-clock speedup over standard decoding."""
    s = speedup(std, mtp)
    if s is None or std.tokens_per_second <= 0:
        return ""
    tps = mtp.tokens_per_second / std.tokens_per_second
    if std.tokens == mtp.tokens:
        # same length: the time ratio is the wall-clock speedup (paper 4.5)
        head = f"{s:.2f}×"
        detail = f"standard {std.seconds:.2f} s vs {mtp.seconds:.2f} s for {std.tokens} tokens"
    else:
        # different lengths: the time ratio would reward stopping early; compare tokens/s instead
        head = f"{tps:.2f}× in tokens/s"
        detail = (f"standard {std.tokens} tokens in {std.seconds:.2f} s, MTP {mtp.tokens} tokens in "
                  f"{mtp.seconds:.2f} s; answers of different length, so the time ratio ({s:.2f}×) is not a speedup")
    same = "identical answers" if std.text == mtp.text else "the answers differ"
    return (f"**Wall-clock speedup of {mtp.strategy.label} over standard: {head}** "
            f"({detail}; each time is the sum of that strategy's own forward passes; {same}).")


def pass_table(std: Pane, mtp: Pane) -> list[list[Any]]:
    """Rows for the per-pass timing table: strategy, pass, real / mask tokens fed, kept, ms, text."""
    rows = []
    for pane, name in ((std, "standard"), (mtp, mtp.strategy.label)):
        for r in pane.records:
            rows.append([name, r.index + 1, r.fed_real, r.fed_masks, len(r.kept), round(r.seconds * 1000, 1),
                         r.text])
    return rows


def model_markdown(lm: LoadedModel, quantization: str = "none") -> str:
    """What is loaded: source, device, mask token, prompt format, MTP-trained or not, warnings."""
    trained = "MTP-trained" if lm.mtp_trained else "**not MTP-trained**"
    lines = [f"**Model:** `{lm.source}` · {lm.device} · quantization {quantization} · mask token id "
             f"{lm.mask_token_id} · prompt format `{lm.prompt_format}` · {trained}"
             + (f" · adapter {lm.adapter}" if lm.adapter else "")
             + (f" · trained with k_max {lm.trained_k_max}" if lm.trained_k_max else "")]
    lines += [f"⚠️ {w}" for w in lm.warnings]
    return "\n\n".join(lines)


def defer_range_check(slider: gr.Slider) -> gr.Slider:
    """Let out-of-range values through to the app's own validation (API callers can send any
    number), so they get the app's message in the status line instead of Gradio's exception."""
    slider.preprocess = lambda payload: payload  # type: ignore[method-assign]
    return slider


def error_md(msg: str) -> str:
    """A status-line error message; also raised as a toast (``gr.Warning``) so that it is seen
    wherever the page is scrolled."""
    gr.Warning(msg)
    return f"⚠️ **Error:** {msg}"


# ---------------------------------------------------------------------------- the app
def build_app(registry: ModelRegistry | None = None, *, preload: bool = True) -> gr.Blocks:
    """Build the Gradio Blocks page.

    Args:
        registry: where models are loaded and cached (a fresh :class:`ModelRegistry` by default).
        preload: load the default model now (so the first answer does not wait for it).

    Returns:
        The ``gr.Blocks``; ``demo.mtp_registry`` is the registry. Launch it with :func:`launch`.
    """
    registry = registry or ModelRegistry()
    gr.set_static_paths([str(figures.PLOTLY_JS)])
    default_key = ModelRegistry.key(DEFAULT_SOURCE, "none")
    default_info = ""
    default_k_max = 16  # the paper's sweep; an adapter trained with a smaller k_max suggests its own
    if preload:
        try:
            default_lm = registry.get(*default_key)
            default_info = model_markdown(default_lm)
            default_k_max = min(default_lm.trained_k_max or default_k_max, APP_MAX_K_MAX)
        except RequestError as e:
            default_info = error_md(str(e))
    cmap = figures.block_colour_map(APP_MAX_K_MAX)

    def outputs_idle(status: str) -> tuple:
        return (gr.skip(),) * 10 + (status,)

    def chat(message, hist_std, hist_mtp, strategy_name, tau, k_max, k, max_new_tokens, model_key):
        try:
            text = check_message(message)
            strategy = build_strategy("static" if str(strategy_name).startswith("static") else "confadapt",
                                      tau, k_max, k)
            n_new = check_max_new_tokens(max_new_tokens)
            source, quant = model_key or default_key
            lm = registry.get(source, quant)
            msgs_std = to_messages(hist_std) + [{"role": "user", "content": text}]
            msgs_mtp = to_messages(hist_mtp) + [{"role": "user", "content": text}]
            ids_std = prompt_ids_for(lm, msgs_std, n_new, strategy.k_max)
            ids_mtp = prompt_ids_for(lm, msgs_mtp, n_new, strategy.k_max)
        except RequestError as e:
            yield outputs_idle(error_md(str(e)))
            return
        except Exception as e:  # noqa: BLE001 - never a traceback in the page
            log.exception("chat request failed")
            yield outputs_idle(error_md(f"{type(e).__name__}: {e}"))
            return

        tau_line = strategy.tau if strategy.name == "confadapt" else None
        label = strategy.label
        turn = sum(1 for m in msgs_std if m["role"] == "user")
        t_start = time.perf_counter()
        last_fig = -1e9
        std = mtp = None
        try:
            yield ("", msgs_std + [{"role": "assistant", "content": ""}],
                   msgs_mtp + [{"role": "assistant", "content": ""}],
                   stats_markdown(None, "standard"), stats_markdown(None, label), "", [],
                   figures.animated_html(figures.passes_figure([], tau=tau_line, k_max=strategy.k_max)),
                   gr.skip(), [], f"Turn {turn}: running standard vs {label} on `{lm.source}`…")
            for std, mtp in run_side_by_side(lm, ids_std, ids_mtp, strategy, n_new):
                now = time.perf_counter()
                finished = std.done and mtp.done
                redraw = finished or now - last_fig >= FIGURE_EVERY_S
                if redraw:
                    last_fig = now
                yield (
                    gr.skip(),
                    msgs_std + [{"role": "assistant", "content": std.text}],
                    msgs_mtp + [{"role": "assistant", "content": mtp.text}],
                    stats_markdown(std, "standard"),
                    stats_markdown(mtp, label),
                    speedup_markdown(std, mtp),
                    figures.coloured_blocks(mtp.records),
                    figures.animated_html(figures.passes_figure(mtp.records, tau=tau_line, k_max=strategy.k_max,
                                                                label=label)) if redraw else gr.skip(),
                    figures.race_figure([("standard", std.records), (label, mtp.records)]) if redraw else gr.skip(),
                    pass_table(std, mtp) if finished else gr.skip(),
                    f"Turn {turn}: done in {now - t_start:.1f} s wall-clock (both strategies, passes alternating)."
                    if finished else gr.skip(),
                )
        except Exception as e:  # noqa: BLE001 - keep serving; show the message
            log.exception("generation failed")
            yield outputs_idle(error_md(f"generation failed: {type(e).__name__}: {e}"))

    if spaces is not None:  # ZeroGPU: hold a GPU for the whole side-by-side generation
        chat = spaces.GPU(duration=120)(chat)

    def load_model(choice, local_path, quantization, model_key):
        try:
            source = parse_source(choice, local_path)
            key = ModelRegistry.key(source, quantization)
            lm = registry.get(*key)
        except RequestError as e:
            current = (model_key or default_key)[0]
            return model_key, gr.skip(), error_md(f"{e} Still using {current}.")
        return key, model_markdown(lm, key[1]), f"Loaded `{key[0]}`."

    def clear():
        return ([], [], "", "", "", [],
                figures.animated_html(figures.passes_figure([], tau=None, k_max=1)), None, [], "Cleared.")

    with gr.Blocks(title="MTP side by side", fill_width=True, analytics_enabled=False) as demo:
        gr.Markdown(
            "# Multi-token prediction, side by side\n"
            "**MTP** lets an ordinary language model propose a block of up to k_max tokens in one forward "
            "pass by appending mask tokens; **ConfAdapt** keeps the leading proposals whose confidence is at "
            f"least tau — [Kirchenbauer et al., *Multi-Token Prediction via Self-Distillation*]({PAPER_URL})."
        )
        model_key = gr.State(default_key)
        with gr.Accordion("Model", open=False):
            with gr.Row():
                model_choice = gr.Dropdown(MODEL_CHOICES, value=DEFAULT_SOURCE, label="Model", scale=3,
                                           info="then press Load model; hub checkpoints need a GPU and network")
                local_path = gr.Textbox(label="…or a local path / hub id", placeholder="/path/to/model or owner/name",
                                        scale=3, elem_id="local-path")
                quantization = gr.Radio(["none", "4bit", "8bit"], value="none", label="Quantization (CUDA only)",
                                        scale=2)
                load_btn = gr.Button("Load model", scale=1, elem_id="load-model")
        model_info = gr.Markdown(default_info, elem_id="model-info")
        with gr.Row():
            strategy = gr.Radio(STRATEGIES, value="ConfAdapt", label="MTP strategy (right pane)", elem_id="strategy")
            tau = defer_range_check(gr.Slider(0.5, 1.0, value=0.9, step=0.01, label="tau (ConfAdapt threshold)",
                                              elem_id="tau"))
            k_max = defer_range_check(gr.Slider(1, APP_MAX_K_MAX, value=default_k_max, step=1, label="k_max (proposals per pass)",
                                                elem_id="k-max"))
            k = defer_range_check(gr.Slider(1, APP_MAX_K_MAX, value=3, step=1, label="k (static k block size)",
                                            elem_id="k"))
            max_new = defer_range_check(gr.Slider(1, 512, value=128, step=1, label="max new tokens",
                                                  elem_id="max-new-tokens"))
        with gr.Row(equal_height=True):
            with gr.Column():
                chat_std = gr.Chatbot(label="Standard decoding (one token per forward pass)", elem_id="chat-standard",
                                      render_markdown=False, height=360, feedback_options=None, layout="panel")
                stats_std = gr.Markdown(stats_markdown(None, "standard"), elem_id="stats-standard",
                                        elem_classes="mtp-stats")
            with gr.Column():
                chat_mtp = gr.Chatbot(label="MTP decoding (ConfAdapt / static k)", elem_id="chat-mtp",
                                      render_markdown=False, height=360, feedback_options=None, layout="panel")
                stats_mtp = gr.Markdown(stats_markdown(None, "MTP"), elem_id="stats-mtp", elem_classes="mtp-stats")
        speed = gr.Markdown(elem_id="speedup")
        with gr.Row():
            message = gr.Textbox(placeholder="Ask something, e.g. a math word problem", show_label=False, scale=6,
                                 elem_id="message", lines=1, max_lines=6)
            send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            stop = gr.Button("Stop", variant="stop", scale=1, elem_id="stop")
            clear_btn = gr.Button("Clear", scale=1, elem_id="clear")
        status = gr.Markdown(elem_id="status")
        gr.Examples(examples=[[p] for p in load_examples()], inputs=[message], label="Example prompts")
        coloured = gr.HighlightedText(label="MTP answer, one highlight per forward pass (label = block width)",
                                      color_map=cmap, combine_adjacent=False, show_legend=False,
                                      show_inline_category=True, elem_id="coloured-answer")
        with gr.Row():
            with gr.Column(scale=3):
                fig_html = gr.HTML(figures.animated_html(figures.passes_figure([], tau=None, k_max=1)),
                                   elem_id="passes-figure", js_on_load=None)
            with gr.Column(scale=2):
                race = gr.Plot(label="Race", elem_id="race")
        with gr.Accordion("Per-pass timing", open=False):
            table = gr.Dataframe(headers=["strategy", "pass", "real fed", "masks fed", "kept", "ms", "text"],
                                 elem_id="pass-table", interactive=False, wrap=True)

        inputs = [message, chat_std, chat_mtp, strategy, tau, k_max, k, max_new, model_key]
        outputs = [message, chat_std, chat_mtp, stats_std, stats_mtp, speed, coloured, fig_html, race, table, status]
        ev_send = send.click(chat, inputs, outputs, api_name="chat", concurrency_limit=CONCURRENCY,
                             concurrency_id="generate")
        ev_submit = message.submit(chat, inputs, outputs, api_name=False, concurrency_limit=CONCURRENCY,
                                   concurrency_id="generate")
        stop.click(lambda: "⏹ Stopped. Send a new message to continue.", None, status, cancels=[ev_send, ev_submit],
                   api_name=False, queue=False)
        clear_btn.click(clear, None, [chat_std, chat_mtp, stats_std, stats_mtp, speed, coloured, fig_html, race,
                                      table, status], api_name=False, cancels=[ev_send, ev_submit])
        load_btn.click(load_model, [model_choice, local_path, quantization, model_key], [model_key, model_info, status],
                       api_name="load_model", concurrency_limit=1)
    demo.mtp_registry = registry  # type: ignore[attr-defined]
    return demo


def launch(demo: gr.Blocks, **kwargs: Any) -> Any:
    """Launch ``demo`` with the page's CSS (Gradio 6 takes css at launch). Extra kwargs go to
    ``gr.Blocks.launch`` (server_name, server_port, prevent_thread_lock, ...)."""
    kwargs.setdefault("css", CSS)
    kwargs.setdefault("footer_links", ["api", "gradio"])
    return demo.queue(default_concurrency_limit=CONCURRENCY).launch(**kwargs)
