"""Side-by-side runner: validates a request, loads models once, and alternates the forward
passes of standard decoding and an MTP strategy (paper 3.4, 4.5) on one worker.

Honest timing (DESIGN.md section 3): the two strategies never run at the same time. One global
lock serialises every forward pass of every session, and :class:`model.decoding.Decoder`
synchronises the device around each pass, so ``PassRecord.seconds`` is the pass's own time.
A strategy's total time is the sum of its own passes; the wall-clock speedup of the MTP side is
``standard seconds / MTP seconds``.

No model code lives here: this module calls the engine (``model.*``) and keeps its records.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from model.checkpoint import DEFAULT_SOURCE, CheckpointError, LoadedModel, load_checkpoint
from model.decoding import Decoder, PassRecord, Strategy, make_strategy, standard

log = logging.getLogger(__name__)

#: Upper bound of the k_max control (the engine allows up to 64; the app offers 1-32).
APP_MAX_K_MAX = 32
#: Upper bound on max_new_tokens per answer.
APP_MAX_NEW_TOKENS = int(os.environ.get("MTP_APP_MAX_NEW_TOKENS", "1024"))
#: Longest prompt (chat history + message, in tokens) the app will prefill. A 20,000-character
#: message is ~5,000 tokens: refused with a message instead of stalling a CPU for minutes.
MAX_PROMPT_TOKENS = int(os.environ.get("MTP_APP_MAX_PROMPT_TOKENS", "2048"))
#: Longest message in characters (checked before tokenising).
MAX_MESSAGE_CHARS = int(os.environ.get("MTP_APP_MAX_MESSAGE_CHARS", "16000"))
QUANTIZATIONS = ("none", "4bit", "8bit")

#: Serialises forward passes across sessions and strategies (honest per-pass timing).
FORWARD_LOCK = threading.Lock()


class RequestError(ValueError):
    """A request the app refuses, with a message meant for the page."""


# ---------------------------------------------------------------------------- validation
def _whole_number(value: Any, name: str) -> int:
    if isinstance(value, bool) or value is None:
        raise RequestError(f"{name} must be a whole number, got {value!r}.")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be a whole number, got {value!r}.") from None
    if math.isnan(f) or math.isinf(f) or f != int(f):
        raise RequestError(f"{name} must be a whole number, got {value!r}.")
    return int(f)


def check_message(message: Any) -> str:
    """The user's message as text.

    Raises:
        RequestError: empty (or whitespace only), or longer than :data:`MAX_MESSAGE_CHARS`.
    """
    text = "" if message is None else str(message)
    if not text.strip():
        raise RequestError("The message is empty: type a question first.")
    if len(text) > MAX_MESSAGE_CHARS:
        raise RequestError(f"The message is {len(text):,} characters long; this demo accepts at most "
                           f"{MAX_MESSAGE_CHARS:,}. Shorten it and send again.")
    return text


def build_strategy(name: Any, tau: Any, k_max: Any, k: Any) -> Strategy:
    """The MTP strategy of the right pane: ``confadapt`` (default) or ``static`` (paper 4.5).

    Args:
        name: ``"confadapt"``, ``"static"`` (``"ConfAdapt"`` / ``"static k"`` labels accepted).
        tau: ConfAdapt threshold in [0, 1].
        k_max: proposals per forward pass, 1-:data:`APP_MAX_K_MAX`.
        k: static block size, 1-k_max.

    Raises:
        RequestError: any invalid value, with a message naming it.
    """
    key = str(name or "confadapt").strip().lower().replace(" ", "")
    key = {"confadapt": "confadapt", "statick": "static", "static": "static"}.get(key, key)
    if key not in ("confadapt", "static"):
        raise RequestError(f"Unknown strategy {name!r}: choose ConfAdapt or static k.")
    k_max_i = _whole_number(k_max, "k_max")
    if not 1 <= k_max_i <= APP_MAX_K_MAX:
        raise RequestError(f"k_max must be between 1 and {APP_MAX_K_MAX}, got {k_max_i}.")
    k_i = _whole_number(k, "k") if key == "static" else 1
    try:
        tau_f = float(tau)
    except (TypeError, ValueError):
        raise RequestError(f"The threshold tau must be a number in [0, 1], got {tau!r}.") from None
    try:
        return make_strategy(key, tau=tau_f, k_max=k_max_i, k=k_i)
    except ValueError as e:
        raise RequestError(str(e)) from None


def check_max_new_tokens(value: Any) -> int:
    """max_new_tokens as an int in 1-:data:`APP_MAX_NEW_TOKENS`. Raises RequestError."""
    n = _whole_number(value, "max new tokens")
    if n < 1:
        raise RequestError(f"max new tokens must be at least 1, got {n}.")
    if n > APP_MAX_NEW_TOKENS:
        raise RequestError(f"max new tokens must be at most {APP_MAX_NEW_TOKENS}, got {n}.")
    return n


def prompt_ids_for(lm: LoadedModel, messages: Sequence[dict], max_new_tokens: int, k_max: int) -> list[int]:
    """Token ids of a chat history for ``lm``, refusing over-long prompts.

    Raises:
        RequestError: empty prompt, or more than :data:`MAX_PROMPT_TOKENS` tokens, or prompt +
            max_new_tokens + k_max beyond the model's ``max_position_embeddings``.
    """
    try:
        ids = lm.prompt_ids(list(messages))
    except ValueError as e:
        raise RequestError(str(e)) from None
    limit = MAX_PROMPT_TOKENS
    max_pos = getattr(getattr(lm.model, "config", None), "max_position_embeddings", None)
    if isinstance(max_pos, int) and max_pos > 0:
        limit = min(limit, max_pos - max_new_tokens - k_max)
    if len(ids) > limit:
        what = "This conversation" if len(messages) > 1 else "The message"
        raise RequestError(f"{what} is {len(ids):,} tokens long; this demo prefills at most {max(limit, 0):,} "
                           "tokens. Shorten the message or press Clear to start a new chat.")
    return ids


# ---------------------------------------------------------------------------- models
def parse_source(choice: Any, local_path: Any) -> str:
    """The model source: the local path / hub id box when filled, else the dropdown's value."""
    path = str(local_path or "").strip()
    return path or str(choice or DEFAULT_SOURCE).strip() or DEFAULT_SOURCE


class ModelRegistry:
    """Models loaded once and cached per ``(source, quantization)`` (least recently used first out).

    Args:
        loader: the engine's :func:`model.checkpoint.load_checkpoint` (or a compatible callable).
        capacity: how many models stay loaded.
    """

    def __init__(self, loader: Callable[..., LoadedModel] = load_checkpoint, capacity: int = 2):
        self._loader = loader
        self._capacity = max(1, capacity)
        self._models: OrderedDict[tuple[str, str], LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[tuple[str, str], threading.Lock] = {}

    @staticmethod
    def key(source: str, quantization: Any = "none") -> tuple[str, str]:
        """Cache key; raises RequestError for an unknown quantization."""
        q = str(quantization or "none").strip().lower()
        if q not in QUANTIZATIONS:
            raise RequestError(f"Unknown quantization {quantization!r}: use none, 4bit or 8bit.")
        return (str(source).strip() or DEFAULT_SOURCE, q)

    def get(self, source: str, quantization: Any = "none") -> LoadedModel:
        """The loaded model for ``source`` (loading it on first use).

        A slow load (a hub checkpoint) only blocks requests for that same model; sessions on
        models already loaded keep generating.

        Raises:
            RequestError: the source cannot be loaded (message from the engine).
        """
        key = self.key(source, quantization)
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            key_lock = self._loading.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._models:  # loaded by another request meanwhile
                    return self._models[key]
            try:
                lm = self._loader(key[0], quantization=None if key[1] == "none" else key[1])
            except CheckpointError as e:
                raise RequestError(str(e)) from None
            except Exception as e:  # noqa: BLE001 - anything a loader raises becomes a page message
                log.exception("loading %s failed", key)
                raise RequestError(f"Could not load {key[0]!r}: {type(e).__name__}: {e}") from None
            with self._lock:
                self._models[key] = lm
                while len(self._models) > self._capacity:
                    self._models.popitem(last=False)
            return lm

    def loaded(self) -> list[tuple[str, str]]:
        """Keys of the models currently loaded."""
        return list(self._models)


# ---------------------------------------------------------------------------- the run
@dataclass
class Pane:
    """One side of the comparison: a strategy, its decoder and the records so far."""

    strategy: Strategy
    decoder: Decoder
    records: list[PassRecord] = field(default_factory=list)
    text: str = ""

    @property
    def done(self) -> bool:
        """True once the decoder has emitted a stop token or max_new_tokens."""
        return self.decoder.done

    @property
    def tokens(self) -> int:
        """Tokens generated so far."""
        return sum(len(r.kept) for r in self.records)

    @property
    def forward_passes(self) -> int:
        """Forward passes run so far (prefill included)."""
        return len(self.records)

    @property
    def seconds(self) -> float:
        """Sum of this strategy's own forward-pass times (s)."""
        return sum(r.seconds for r in self.records)

    @property
    def effective_k(self) -> float:
        """Tokens per forward pass."""
        return self.tokens / self.forward_passes if self.records else 0.0

    @property
    def tokens_per_second(self) -> float:
        """tokens / seconds (0 before the first pass)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_ms_per_pass(self) -> float:
        """Mean time of the passes after prefill (ms); the prefill pass when it is the only one."""
        rs = self.records[1:] or self.records
        return 1000 * sum(r.seconds for r in rs) / len(rs) if rs else 0.0

    @property
    def prefill_ms(self) -> float:
        """Time of the first forward pass (prompt + masks), in ms."""
        return 1000 * self.records[0].seconds if self.records else 0.0


def run_side_by_side(
    lm: LoadedModel,
    std_prompt: Sequence[int],
    mtp_prompt: Sequence[int],
    mtp_strategy: Strategy,
    max_new_tokens: int,
    *,
    lock: threading.Lock = FORWARD_LOCK,
) -> Iterator[tuple[Pane, Pane]]:
    """Alternate one forward pass of standard decoding and one of ``mtp_strategy``.

    Each pass runs alone under ``lock`` (no two passes of any session overlap), so its
    ``seconds`` is honest. Yields ``(standard_pane, mtp_pane)`` after every pass; the side that
    finishes first simply stops taking turns.

    Raises:
        ValueError: from the engine (empty prompt, bad max_new_tokens).
    """
    panes = (Pane(standard(), Decoder(lm, std_prompt, standard(), max_new_tokens)),
             Pane(mtp_strategy, Decoder(lm, mtp_prompt, mtp_strategy, max_new_tokens)))
    while not all(p.done for p in panes):
        for pane in panes:
            if pane.done:
                continue
            with lock:
                rec = pane.decoder.step()
            pane.records.append(rec)
            pane.text += rec.text
            yield panes


def speedup(std: Pane, mtp: Pane) -> float | None:
    """Wall-clock speedup of the MTP side over standard decoding: ``std.seconds / mtp.seconds``
    (both the sums of their own passes); None until both have run a pass."""
    if std.seconds <= 0 or mtp.seconds <= 0:
        return None
    return std.seconds / mtp.seconds
