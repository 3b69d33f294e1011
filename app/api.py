"""What API and MCP clients call: plain values, never Gradio's update dicts (:mod:`app.ui` wires them as ``/chat``,
``/chat_summary`` and ``/load_model``). A mixin of :class:`app.page.Page`: every call is independent (no session:
the conversation is exactly the history sent) and runs through the page's own turn (:meth:`Page.turn_updates
<app.page.Page.turn_updates>`)."""

from __future__ import annotations

import json
from typing import Any

import gradio as gr

from model.errors import RequestError

from . import render
from .headline import agent_summary
from .outputs import TURN_OUTPUTS, plain_outputs
from .requests import TurnRequest, app_k_max


class ApiHandlers:
    """The API's handlers (module docstring); their docstrings are what ``view_api()`` and the MCP tools say."""

    def chat_api(self, message: str, history: list, strategy: str, tau: float, k_max: int, k: int,
                 max_new_tokens: int, shape: str, model_key: Any, temperature: float = 0.0, top_p: float = 1.0,
                 request: gr.Request = None) -> tuple:
        """Answer one chat message with standard decoding and an MTP strategy side by side (MCP tool and /chat).
        Every call is independent: the conversation is exactly the history given.

        Args:
            message: the user's message.
            history: the conversation so far, [] for a new chat: [{"role": "user", "content": "..."}, ...].
            strategy: the MTP side's strategy: "ConfAdapt", "static k" or "lossless".
            tau: ConfAdapt's confidence threshold, 0 to 1 (0.9 keeps answers close to standard decoding).
            k_max: most tokens per forward pass (lossless: the upper bound), 1 to 32.
            k: static k's tokens per pass, 1 to 32.
            max_new_tokens: most tokens per answer, 1 to 1024.
            shape: lossless only: "fastest here", "linear", "full tree" or mask-block prefixes such as "0/1/3".
            model_key: [source, quantization, precision], e.g. ["smollm2-135m", "none", "auto"].
            temperature: 0 decodes greedily (default); above 0, up to 2, both sides sample (lossless then keeps the
                distribution of standard sampling, not its draws).
            top_p: nucleus sampling, (0, 1]; 1 = off.

        Returns:
            15 plain values: the message box, history, panes, counters, headline, figures, table, status and notice
            then the trade-off figure and the result: a JSON summary of both answers and their speed
        """
        start = {name: None for name in TURN_OUTPUTS}
        start.update(message=message, history=history if isinstance(history, list) else [], notice="", status="",
                     speed="", table="")
        turn = TurnRequest(message, history, strategy, tau, k_max, k, max_new_tokens, model_key, shape, stream=False,
                           temperature=temperature, top_p=top_p)
        return plain_outputs(self.turn_updates(turn, None), start)  # independent calls: no shared record

    def chat_summary(self, message: str, history: list, strategy: str = "ConfAdapt", tau: float = 0.9,
                     k_max: int | None = None, k: int = 3, max_new_tokens: int = 128, shape: str = "fastest here",
                     model_key: Any = None, temperature: float = 0.0, top_p: float = 1.0,
                     request: gr.Request = None) -> str:
        """Answer one chat message twice, with standard decoding and with a multi-token-prediction (MTP) strategy,
        and say how much faster MTP was. Every call is independent: the conversation is exactly the history given.

        Args:
            message: the user's message.
            history: the conversation so far, [] for a new chat: [{"role": "user", "content": "..."}, ...].
            strategy: the MTP side's strategy: "ConfAdapt", "static k" or "lossless".
            tau: ConfAdapt's confidence threshold, 0 to 1 (0.9 keeps answers close to standard decoding).
            k_max: most tokens per forward pass (lossless: the upper bound), 1 to 32; empty: the model's own.
            k: static k's tokens per pass, 1 to 32.
            max_new_tokens: most tokens per answer, 1 to 1024.
            shape: lossless only: "fastest here", "linear", "full tree" or mask-block prefixes such as "0/1/3".
            model_key: [source, quantization, precision]; empty: the embedded default model.
            temperature: 0 decodes greedily (default); above 0, up to 2, both sides sample.
            top_p: nucleus sampling, (0, 1]; 1 = off.

        Returns:
            A JSON object with phase ("done", "stopped", "error" or "refused") and status (in words)
            headline (the speed and its cost in one sentence) and warning (true when the MTP answer is worse)
            speedup (MTP tokens per second over standard's) and identical (both answers are the same text)
            sampling (temperature, top_p, top_k, seed) and the two answers as standard and mtp
            each with text, new_tokens, forward_passes, effective_k and tokens_per_second (mtp: also strategy)
        """
        out = self.chat_api(message, history, strategy, tau, k_max, k, max_new_tokens, shape, model_key,
                            temperature, top_p)
        return json.dumps(agent_summary(out[TURN_OUTPUTS.index("result")] or {}), ensure_ascii=False,
                          allow_nan=False)

    def load_model_api(self, choice: str, local_path: str, quantization: str, precision: str, model_key: Any
                       ) -> tuple:
        """Load another model for the chat (MCP tool and /load_model); a model that cannot load leaves the current one.

        Args:
            choice: "smollm2-135m" (the embedded default), a hub id (needs network) or a local path.
            local_path: a local path or hub id that replaces choice when not empty.
            quantization: "none", "4bit" or "8bit" (bitsandbytes, CUDA only).
            precision: "auto" (bf16 where the hardware computes it natively), "float32" or "bfloat16".

        Returns:
            (model info as HTML, status line as HTML, the model's k_max), plain values.
        """
        try:
            key, lm = self.load(choice, local_path, quantization, precision)
            return key, render.model_html(lm, key[1]), render.status_html(f"Loaded {key[0]}."), \
                app_k_max(lm.default_k_max)
        except RequestError as e:
            key = self.key_of(model_key)
            lm = self.loaded(key)
            info = render.model_html(lm, key[1]) if lm is not None else ""
            k = app_k_max(lm.default_k_max) if lm is not None else self.default_k_max
            return key, info, render.status_html(f"{e} Still using {key[0]}.", kind="error"), k
