"""What a chat turn asks for, checked: the app's limits, the page's controls read in the engine's vocabulary, and
:class:`TurnRequest`, the one value that carries a request from the page to the engine (paper 3.4, 4.5).

Every check raises :class:`~model.errors.RequestError` with a message meant for the page: it names the rule and the
value, in the user's words. No Gradio type and no model code here.
"""

from __future__ import annotations

import json
import os
import unicodedata
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from model.engine.loading import DEFAULT_SOURCE
from model.engine.sampling import Sampling, parse_sampling
from model.engine.strategies import (
    DEFAULT_K_MAX,
    DEFAULT_STATIC_K,
    DEFAULT_TAU,
    Strategy,
    parse_whole_number,
    resolve_strategy,
    verify_layout,
)
from model.errors import RequestError

from .device import SHAPE_CHOICES

# ---------------------------------------------------------------------------- the app's limits (written once)
#: Largest k_max (and static k) the app offers; the engine allows up to 64.
APP_MAX_K_MAX = 32
#: Largest max_new_tokens per side.
APP_MAX_NEW_TOKENS = int(os.environ.get("MTP_APP_MAX_NEW_TOKENS", "1024"))
#: The max_new_tokens box's first value.
DEFAULT_MAX_NEW_TOKENS = 128
#: Longest prompt (conversation + message) the app prefills, in tokens.
MAX_PROMPT_TOKENS = int(os.environ.get("MTP_APP_MAX_PROMPT_TOKENS", "2048"))
#: Longest message, in characters.
MAX_MESSAGE_CHARS = int(os.environ.get("MTP_APP_MAX_MESSAGE_CHARS", "16000"))
#: The temperature control's top (the engine takes up to MAX_TEMPERATURE; past 2 a 135M model writes noise).
APP_MAX_TEMPERATURE = 2.0
#: The model menu's quantizations (bitsandbytes, CUDA only) and precisions.
QUANTIZATIONS = ("none", "4bit", "8bit")
PRECISIONS = ("auto", "float32", "bfloat16")
#: The page's example prompts.
EXAMPLES_FILE = Path(__file__).resolve().parent.parent / "assets" / "examples.json"
#: The page's strategy labels -> the engine's strategy names.
STRATEGY_LABELS = {"ConfAdapt": "confadapt", "static k": "static", "lossless": "verify"}
STRATEGY_CHOICES = tuple(STRATEGY_LABELS)


def app_k_max(model_k_max: int | None = None) -> int:
    """The k_max the app uses by default: the model's own (:attr:`LoadedModel.default_k_max
    <model.engine.loaded_model.LoadedModel.default_k_max>`; the engine's default when None), capped at
    :data:`APP_MAX_K_MAX`. The one place this rule is written."""
    return min(model_k_max or DEFAULT_K_MAX, APP_MAX_K_MAX)


def k_max_limit(value: Any, default: int | None) -> int | None:
    """The k_max box as a limit: its value when a whole number in [1, :data:`APP_MAX_K_MAX`], else ``default``
    (an empty or half-typed box must not break the figures drawn from it)."""
    try:
        k = int(float(value))
    except (TypeError, ValueError):
        return default
    return k if 1 <= k <= APP_MAX_K_MAX and k == float(value) else default


def choice_of(strategy: Strategy) -> str:
    """The page's label of an engine strategy (``verify`` -> ``lossless``)."""
    return next((label for label, name in STRATEGY_LABELS.items() if name == strategy.name), "ConfAdapt")


# ---------------------------------------------------------------------------- the request
@dataclass(frozen=True)
class TurnRequest:
    """One chat turn as the page (or an API client) asked for it: plain data, unchecked, so it pickles into a
    ZeroGPU worker. :func:`app.turn.prepare_turn` checks it and builds the :class:`~app.turn.Turn`.

    Attributes:
        message: the user's message.
        history: the conversation before it (:func:`parse_history`'s forms), as sent.
        strategy: the right pane's strategy, a label of :data:`STRATEGY_CHOICES` (or the engine's name).
        tau: ConfAdapt's threshold, 0 to 1.
        k_max: proposals per pass (lossless: the upper bound of the shape); None: the model's own.
        k: static k's block size.
        max_new_tokens: per side, 1 to :data:`APP_MAX_NEW_TOKENS`.
        model_key: ``(source, quantization[, precision])``; the default model when empty.
        shape: lossless only, one of :data:`SHAPE_CHOICES` or mask-block prefixes such as ``0/1/3``.
        run_id: names the run's stop flag (:func:`app.sessions.stop_requested`), set when the run starts.
        stream: False for API clients (who read the last outputs only): only the first and last states are
            rendered.
        temperature: 0 (greedy, the default) to :data:`APP_MAX_TEMPERATURE`; both sides sample alike above 0.
        top_p: nucleus sampling's share, (0, 1]; 1 = off.
        seed: the turn's random seed (both sides draw from it); None: a fresh one, reported in the result.
        session: the page session the turn belongs to (its KV caches are kept for the next turn:
            :mod:`app.prefixes`); None for API calls, which are independent.
    """

    message: Any = ""
    history: Any = ()
    strategy: Any = "ConfAdapt"
    tau: Any = DEFAULT_TAU
    k_max: Any = None
    k: Any = DEFAULT_STATIC_K
    max_new_tokens: Any = DEFAULT_MAX_NEW_TOKENS
    model_key: Any = ()
    shape: Any = "linear"
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    stream: bool = True
    temperature: Any = 0.0
    top_p: Any = 1.0
    seed: Any = None
    session: str | None = None

    def with_(self, **changes: Any) -> "TurnRequest":
        """A copy with ``changes`` (the value itself never changes)."""
        return replace(self, **changes)

    @property
    def key(self) -> tuple:
        """The model key, or the default model's when empty (not checked: :meth:`ModelRegistry.key
        <app.registry.ModelRegistry.key>` checks it)."""
        return tuple(self.model_key) if self.model_key else (DEFAULT_SOURCE, "none", "auto")


# ---------------------------------------------------------------------------- checks
def is_blank(text: str) -> bool:
    """True when ``text`` shows nothing: only whitespace, format characters (Unicode category Cf: zero-width
    space / joiners, direction marks, BOM, ...) and control characters."""
    return all(c.isspace() or unicodedata.category(c) in ("Cf", "Cc") for c in text)


def check_message(message: Any) -> str:
    """The user's message as text.

    Raises:
        RequestError: empty (nothing but whitespace and invisible characters, see :func:`is_blank`), or
            longer than :data:`MAX_MESSAGE_CHARS`.
    """
    text = "" if message is None else str(message)
    if is_blank(text):
        raise RequestError("The message is empty: type a question first.")
    if len(text) > MAX_MESSAGE_CHARS:
        raise RequestError(f"The message is {len(text):,} characters long; this demo accepts at most "
                           f"{MAX_MESSAGE_CHARS:,}. Shorten it and send again.")
    return text


def _content_text(content: Any, where: str) -> str:
    """Text of a message content: a string, or Gradio's ``{"type": "text", "text": ...}`` part(s)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        return content["text"]
    if isinstance(content, (list, tuple)) and all(isinstance(c, (str, dict)) for c in content):
        return "".join(_content_text(c, where) for c in content)
    raise RequestError(f"{where}: the content must be text (a string), got {type(content).__name__}.")


def parse_history(history: Any) -> list[dict]:
    """The conversation before this turn as ``[{"role", "content": str, "mtp"?: str}, ...]``.

    Accepts the messages format with plain-string content (``{"role": "user", "content": "hi"}``),
    Gradio's content parts, and ``[user, assistant]`` pairs. Assistant messages may carry ``"mtp"``:
    the MTP side's own answer (shown in its pane; the context of later turns is ``"content"``, the
    standard answer).

    Raises:
        RequestError: anything else, naming the item.
    """
    if history is None or history == "":
        return []
    if not isinstance(history, (list, tuple)):
        raise RequestError(f"The history must be a list of messages, got {type(history).__name__}.")
    out: list[dict] = []
    for i, item in enumerate(history):
        where = f"History item {i + 1}"
        if isinstance(item, (list, tuple)) and len(item) == 2:  # [user, assistant] pair
            for role, c in zip(("user", "assistant"), item):
                if c is not None:
                    out.append({"role": role, "content": _content_text(c, where)})
            continue
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be a message {{\"role\": ..., \"content\": ...}}, "
                               f"got {type(item).__name__}.")
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise RequestError(f"{where}: role must be user, assistant or system, got {role!r}.")
        msg = {"role": role, "content": _content_text(item.get("content", ""), where)}
        if role == "assistant" and item.get("mtp") is not None:
            msg["mtp"] = _content_text(item["mtp"], where)
        out.append(msg)
    return out


def app_strategy(choice: Any, tau: Any = DEFAULT_TAU, k_max: Any = None, k: Any = None,
                 default_k_max: int | None = None) -> Strategy:
    """The right pane's MTP strategy from the page's controls, in one call to the engine's
    :func:`~model.engine.strategies.resolve_strategy` with the app's cap :data:`APP_MAX_K_MAX`.

    Args:
        choice: the page's label (:data:`STRATEGY_LABELS`; case ignored) or the engine's name.
        tau, k_max, k: the controls (static k has no k_max control: ``k`` is its block size).
        default_k_max: the model's k_max, used when ``k_max`` is None.

    Raises:
        RequestError: an unknown label or a bad parameter.
    """
    key = str(choice or "").strip().lower()
    names = {**{label.lower(): name for label, name in STRATEGY_LABELS.items()},
             **{name: name for name in STRATEGY_LABELS.values()}}  # API clients may use the engine's names
    name = names.get(key)
    if name is None:
        if key == "standard":
            raise RequestError(f"The right pane needs an MTP strategy: choose {', '.join(STRATEGY_CHOICES)}.")
        raise RequestError(f"Unknown strategy {choice!r}: choose {', '.join(STRATEGY_CHOICES)}.")
    if tau is None and name == "confadapt":
        raise RequestError("The threshold tau is empty: enter a number from 0 to 1.")
    if k is None and name == "static":
        raise RequestError(f"k is empty: enter a whole number from 1 to {APP_MAX_K_MAX}.")
    try:
        return resolve_strategy(name, tau=tau, k_max=None if name == "static" else k_max, k=k,
                                default_k_max=default_k_max or APP_MAX_K_MAX, cap=APP_MAX_K_MAX)
    except ValueError as e:
        raise RequestError(str(e)) from None


def app_sampling(temperature: Any, top_p: Any, seed: Any = None) -> Sampling:
    """Both sides' sampling settings from the page's controls: temperature 0 (greedy) to
    :data:`APP_MAX_TEMPERATURE`, top-p in (0, 1]; a turn without a seed gets a fresh one (both sides draw from the
    same seed, each with its own generator).

    Raises:
        RequestError: an empty box, a value that is not a number or out of range (the rule and the value named).
    """
    for value, name in ((temperature, "The temperature"), (top_p, "top-p")):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise RequestError(f"{name} is empty: enter a number ({'0 = greedy' if name != 'top-p' else '1 = off'}).")
    try:
        sampling = parse_sampling(temperature, top_p, 0, seed)
    except ValueError as e:
        raise RequestError(str(e)) from None
    if sampling.temperature > APP_MAX_TEMPERATURE:
        raise RequestError(f"The temperature must be from 0 (greedy) to {APP_MAX_TEMPERATURE:g} here, got "
                           f"{temperature!r}.")
    if not sampling.greedy and sampling.seed is None:
        sampling = replace(sampling, seed=int.from_bytes(os.urandom(4), "big"))
    return sampling


def check_page_controls(choice: Any, tau: Any, k_max: Any, k: Any) -> None:
    """The page's boxes that the chosen strategy reads are filled: an emptied tau or k_max box is refused, not read
    as a default (an API client may leave k_max out: the model's own, :func:`app_k_max`).

    Raises:
        RequestError: the empty box named, with what to enter.
    """
    name = STRATEGY_LABELS.get(str(choice or ""), str(choice or "").strip().lower())
    def empty(v: Any) -> bool:
        return v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and v != v)
    if name == "confadapt" and empty(tau):
        raise RequestError("The threshold tau is empty: enter a number from 0 to 1.")
    if name in ("confadapt", "verify") and empty(k_max):
        raise RequestError(f"k_max is empty: enter a whole number from 1 to {APP_MAX_K_MAX}.")
    if name == "static" and empty(k):
        raise RequestError(f"k is empty: enter a whole number from 1 to {APP_MAX_K_MAX}.")


def check_settings(request: TurnRequest) -> None:
    """Refuse now what :func:`app.turn.prepare_turn` would refuse in the request itself (the message, the history
    sent, the strategy and its controls, max new tokens, sampling, a lossless shape), before the message waits
    behind the session's running turn: refused only once its turn came, it would be gone from the box. What
    needs the model (its own k_max, the prompt's length in tokens) is checked when the turn starts.

    Raises:
        RequestError: as those checks do.
    """
    check_message(request.message)  # in prepare_turn's order, so the same error comes first
    parse_history(request.history)
    app_max_new_tokens(request.max_new_tokens)
    app_sampling(request.temperature, request.top_p, request.seed)
    strategy = app_strategy(request.strategy, request.tau, request.k_max, request.k)
    if strategy.lossless:
        check_shape(request.shape)


def app_max_new_tokens(value: Any) -> int:
    """max_new_tokens from 1 to :data:`APP_MAX_NEW_TOKENS` (the engine's check, the app's bound).

    Raises:
        RequestError: empty, not a whole number, or out of range (the rule and the value named)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RequestError(f"max new tokens is empty: enter a whole number from 1 to {APP_MAX_NEW_TOKENS}.")
    try:  # named as the page labels its box (the engine's check says max_new_tokens)
        return parse_whole_number(value, "max new tokens", 1, APP_MAX_NEW_TOKENS)
    except ValueError as e:
        raise RequestError(str(e)) from None


def check_shape(shape: Any) -> str:
    """A lossless shape from the page or an API client: ``fastest here``, ``linear``, ``full tree`` (or the
    engine's ``full``, or mask-block prefixes such as ``0/1/3``); None and "" mean linear.

    Raises:
        RequestError: anything else, naming the choices."""
    text = str(shape or "linear").strip().lower()
    if text in ("fastest here", "fastest"):
        return "fastest here"
    if text in ("full tree", "full"):
        return "full"
    try:
        verify_layout(64, text)
    except ValueError:
        raise RequestError(f"Unknown lossless shape {shape!r}: choose {', '.join(SHAPE_CHOICES)} "
                           "(or mask-block prefixes such as 0/1/3).") from None
    return text


def parse_source(choice: Any, local_path: Any) -> str:
    """The model source: the local path / hub id box when filled, else the dropdown's value."""
    path = str(local_path or "").strip()
    return path or str(choice or DEFAULT_SOURCE).strip() or DEFAULT_SOURCE


def load_examples(path: Path = EXAMPLES_FILE) -> list[str]:
    """Example prompts from ``assets/examples.json`` (a list of ``{"kind", "prompt"}``)."""
    try:
        return [e["prompt"] for e in json.loads(path.read_text())]
    except (OSError, ValueError, KeyError, TypeError):
        return ["What is 12 times 7? Think step by step."]
