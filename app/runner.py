"""One chat turn, standard decoding against an MTP strategy, without any Gradio type (paper 3.4, 4.5).

* :func:`prepare_turn` validates a request with the engine's own vocabulary
  (:mod:`model.engine.strategies`) plus the app's limits below, finds the model, builds the messages and
  the prompt ids, and checks the context budget: a :class:`Turn`, or a :class:`RequestError` with a
  message meant for the page.
* :func:`run_turn` runs a turn: one forward pass of each side in turn, yielding a
  :class:`TurnState` (plain records: the engine's :class:`~model.engine.decoding.GenerationResult` of each
  side) after every pass, and a last state that says how the turn ended (done, stopped, cleared,
  error).
* :class:`SessionRuns` allows one run per session at a time and carries Stop / Clear to it.
* :func:`estimate_speedup` turns the two sides' pass records into a load-robust speedup with an
  interval.

Like with like: both sides answer the same prompt ids. From turn 2 on the conversation's earlier
answers are the standard side's (the reference); the MTP side's own earlier answers are shown, not
fed back.

Honest timing (DESIGN.md section 3): no two forward passes of any session overlap (one global
lock, :func:`exclusive`, which the page also holds while it renders), the two sides alternate
pass by pass in ABBA order (neither always goes first), and the speedup is computed from per-pass
medians of paired passes, so a load spike or another session's work shifts both sides alike.

No model code lives here: this module calls the engine (``model.*``) and keeps its records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import statistics
import tempfile
import threading
import time
import unicodedata
import uuid
from collections import OrderedDict
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from model.engine.decoding import Decoder, GenerationResult, PassRecord
from model.engine.loaded_model import LoadedModel
from model.engine.loading import DEFAULT_SOURCE, load_checkpoint
from model.engine.scoring import teacher_nll
from model.engine.strategies import (
    DEFAULT_TAU,
    Strategy,
    Verify,
    check_max_new_tokens,
    resolve_strategy,
    standard,
    verify_layout,
)
from model.errors import CheckpointError, NonFiniteLogitsError, RequestError

from .device import SHAPE_CHOICES, LosslessShape, ModelFacts

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- the app's policy (written once)
#: Largest k_max (and static k) the app offers; the engine allows up to 64.
APP_MAX_K_MAX = 32
#: Largest max_new_tokens per answer.
APP_MAX_NEW_TOKENS = int(os.environ.get("MTP_APP_MAX_NEW_TOKENS", "1024"))
#: max_new_tokens the page starts with.
DEFAULT_MAX_NEW_TOKENS = 128
#: Longest prompt (conversation + message, in tokens) the app prefills: a 20,000-character message
#: is ~5,000 tokens, refused with a message instead of stalling a CPU for minutes.
MAX_PROMPT_TOKENS = int(os.environ.get("MTP_APP_MAX_PROMPT_TOKENS", "2048"))
#: Longest message in characters (checked before tokenising).
MAX_MESSAGE_CHARS = int(os.environ.get("MTP_APP_MAX_MESSAGE_CHARS", "16000"))
#: Quantization choices (bitsandbytes, CUDA only).
QUANTIZATIONS = ("none", "4bit", "8bit")
#: Precisions a model can be loaded in: auto = bfloat16 where the device computes it natively, else float32.
PRECISIONS = ("auto", "float32", "bfloat16")
#: The MTP strategies of the right pane: the page's label -> the engine's strategy name.
STRATEGY_LABELS = {"ConfAdapt": "confadapt", "static k": "static", "lossless": "verify"}
STRATEGY_CHOICES = tuple(STRATEGY_LABELS)


def choice_of(strategy: Strategy) -> str:
    """The page's label of an engine strategy (``verify`` -> ``lossless``)."""
    return next((label for label, name in STRATEGY_LABELS.items() if name == strategy.name), "ConfAdapt")

#: Serialises forward passes (and the page's rendering) across sessions: honest per-pass timing.
FORWARD_LOCK = threading.Lock()


def exclusive(lock: threading.Lock = FORWARD_LOCK) -> contextlib.AbstractContextManager:
    """Context in which no forward pass of any session runs (hold it for CPU-heavy rendering)."""
    return lock


# ---------------------------------------------------------------------------- validation
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


def app_max_new_tokens(value: Any) -> int:
    """max_new_tokens from 1 to :data:`APP_MAX_NEW_TOKENS` (the engine's check, the app's bound).

    Raises:
        RequestError: empty, not a whole number, or out of range (the rule and the value named)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RequestError(f"max new tokens is empty: enter a whole number from 1 to {APP_MAX_NEW_TOKENS}.")
    try:
        return check_max_new_tokens(value, APP_MAX_NEW_TOKENS)
    except ValueError as e:
        raise RequestError(str(e)) from None


# ---------------------------------------------------------------------------- models
def parse_source(choice: Any, local_path: Any) -> str:
    """The model source: the local path / hub id box when filled, else the dropdown's value."""
    path = str(local_path or "").strip()
    return path or str(choice or DEFAULT_SOURCE).strip() or DEFAULT_SOURCE


class ModelRegistry:
    """Models loaded once and cached per ``(source, quantization, precision)`` (least recently used first out),
    with what each trades on this device (:attr:`facts`: width profile, lossless shape, sweep).

    Args:
        loader: the engine's :func:`model.engine.loading.load_checkpoint` (or a compatible callable).
        capacity: how many models stay loaded.
    """

    def __init__(self, loader: Callable[..., LoadedModel] = load_checkpoint, capacity: int = 2):
        self._loader = loader
        self._capacity = max(1, capacity)
        #: Width profiles and sweeps of the models, per key (:class:`app.device.ModelFacts`).
        self.facts = ModelFacts(FORWARD_LOCK)
        self._models: OrderedDict[tuple[str, str, str], LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[tuple[str, str, str], threading.Lock] = {}

    @staticmethod
    def key(source: Any, quantization: Any = "none", precision: Any = "auto") -> tuple[str, str, str]:
        """Cache key ``(source, quantization, precision)``; raises RequestError for an unknown
        quantization or precision."""
        q = str(quantization or "none").strip().lower()
        if q not in QUANTIZATIONS:
            raise RequestError(f"Unknown quantization {quantization!r}: use {', '.join(QUANTIZATIONS)}.")
        p = str(precision or "auto").strip().lower()
        if p not in PRECISIONS:
            raise RequestError(f"Unknown precision {precision!r}: use {', '.join(PRECISIONS)}.")
        return (str(source or "").strip() or DEFAULT_SOURCE, q, p)

    def get(self, source: Any, quantization: Any = "none", precision: Any = "auto") -> LoadedModel:
        """The loaded model for ``source`` (loading it on first use).

        A slow load (a hub checkpoint) only blocks requests for that same model; sessions on
        models already loaded keep generating.

        Raises:
            RequestError: the source cannot be loaded (message from the engine).
        """
        key = self.key(source, quantization, precision)
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
                lm = self._loader(key[0], quantization=None if key[1] == "none" else key[1], dtype=key[2])
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

    def loaded(self) -> list[tuple[str, str, str]]:
        """Keys of the models currently loaded."""
        return list(self._models)


# ---------------------------------------------------------------------------- a turn
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

    @property
    def messages(self) -> list[dict]:
        """The messages the prompt was built from (engine form: role and content only)."""
        return engine_messages(self.history) + [{"role": "user", "content": self.message}]


def engine_messages(history: Sequence[dict]) -> list[dict]:
    """History messages as the engine reads them: ``{"role", "content"}`` (the standard answers)."""
    return [{"role": m["role"], "content": m["content"]} for m in history]


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


def lossless_strategy(strategy: Strategy, shape: str, registry: "ModelRegistry", key: tuple, lm: LoadedModel
                      ) -> tuple[Strategy, LosslessShape | None]:
    """The lossless strategy a turn runs: the k_max box's value is the upper bound of the shape chosen for
    this device (``fastest here``: :meth:`app.device.ModelFacts.shape`, measuring the width profile if it is
    not known yet), or the fixed layout at that k_max. Other strategies pass through.

    Raises:
        RequestError: a layout that does not fit the k_max."""
    if not isinstance(strategy, Verify):
        return strategy, None
    if shape == "fastest here":
        chosen = registry.facts.shape(key, lm, strategy.k_max)
        if chosen is not None:
            return chosen.strategy, chosen
        return strategy, None  # no width profile (the measurement failed): the linear layout, as set
    try:
        return Verify(k_max=strategy.k_max, blocks=verify_layout(strategy.k_max, shape)), None
    except ValueError as e:
        raise RequestError(str(e)) from None


def prepare_turn(
    registry: ModelRegistry,
    message: Any,
    history: Any = None,
    strategy: Any = "ConfAdapt",
    tau: Any = DEFAULT_TAU,
    k_max: Any = None,
    k: Any = None,
    max_new_tokens: Any = DEFAULT_MAX_NEW_TOKENS,
    model_key: Sequence[str] | None = None,
    shape: Any = "linear",
) -> Turn:
    """Validate one request and build its :class:`Turn` (loading the model if needed).

    Args:
        registry: where the model is found.
        message: the user's message.
        history: the conversation so far (see :func:`parse_history`).
        strategy, tau, k_max, k: the right pane's strategy (see :func:`app_strategy`); k_max
            defaults to the model's :attr:`~model.engine.loaded_model.LoadedModel.default_k_max`.
        max_new_tokens: per side, 1 to :data:`APP_MAX_NEW_TOKENS`.
        model_key: ``(source, quantization[, precision])``; the default model when None.
        shape: lossless only (:func:`check_shape`): ``fastest here`` runs the shape chosen for this device
            with k_max at most the k_max given (:func:`lossless_strategy`); ``linear`` (default), ``full
            tree`` or prefixes such as ``0/1/3`` run that layout at the k_max given.

    Raises:
        RequestError: with a message for the page (bad input, model not loadable, prompt too long
            for the app or for the model's positions).
    """
    text = check_message(message)
    hist = parse_history(history)
    key = ModelRegistry.key(*(model_key or (DEFAULT_SOURCE,)))
    n_new = app_max_new_tokens(max_new_tokens)
    lm = registry.get(*key)
    strat, chosen = app_strategy(strategy, tau, k_max, k, lm.default_k_max), None
    if strat.verifies:  # the shape is checked only where it is used
        strat, chosen = lossless_strategy(strat, check_shape(shape), registry, key, lm)
    turn_messages = engine_messages(hist) + [{"role": "user", "content": text}]
    try:
        ids = lm.prompt_ids(turn_messages)
    except ValueError as e:
        raise RequestError(str(e)) from None
    if len(ids) > MAX_PROMPT_TOKENS:
        what = "This conversation" if hist else "The message"
        raise RequestError(f"{what} is {len(ids):,} tokens long; this demo prefills at most "
                           f"{MAX_PROMPT_TOKENS:,} tokens. Shorten the message or press Clear to start a new chat.")
    try:  # the engine checks the context budget (the MTP side looks further ahead than standard)
        sides = {"standard": Decoder(lm, ids, standard(), n_new), "mtp": Decoder(lm, ids, strat, n_new)}
    except ValueError as e:
        raise RequestError(str(e)) from None
    number = sum(1 for m in hist if m["role"] == "user") + 1
    return Turn(lm=lm, strategy=strat, max_new_tokens=n_new, history=hist, message=text, prompt_ids=list(ids),
                number=number, model_key=key, sides=sides, shape=chosen)


#: Seconds a ZeroGPU request may hold the GPU at most (a free visitor's daily quota is 5 minutes).
GPU_SECONDS_MAX = 240
#: What a GPU turn costs besides its passes: a worker's first use (packing the fast path), rendering.
GPU_SECONDS_OVERHEAD = 10.0
#: Seconds of one forward pass on a GPU at batch 1: kernel launches dominate a model of this project's size;
#: a larger model adds the time to read its weights (~2 TB/s).
GPU_PASS_SECONDS = 0.03
GPU_READ_BYTES_PER_SECOND = 2e12


def gpu_seconds(message: Any, history: Any, strategy: Any, tau: Any, k_max: Any, k: Any, max_new_tokens: Any,
                model_key: Any, run_id: Any = None, shape: Any = None, stream: Any = True) -> int:
    """The GPU time a turn asks ZeroGPU for, from the same arguments as the turn (``spaces.GPU``'s
    ``duration`` callable; it runs in the main process before the GPU is granted, so it only reads).

    Both sides may take up to ``max_new_tokens`` passes (the MTP side fewer); a pass costs
    :data:`GPU_PASS_SECONDS` plus the model's weights read at :data:`GPU_READ_BYTES_PER_SECOND`, and 1%
    more per token fed (``2 k_max`` for the linear layout, ``k_max²`` for a tree; a wider pass costs little more
    on a GPU at batch 1). A short answer asks for little and so queues first; the result is clamped to
    [15, :data:`GPU_SECONDS_MAX`] seconds. The overhead covers measuring the width profile on first use."""
    try:
        n = min(max(int(float(max_new_tokens)), 1), APP_MAX_NEW_TOKENS)
    except (TypeError, ValueError):
        n = DEFAULT_MAX_NEW_TOKENS
    size = 0
    source = (model_key or (DEFAULT_SOURCE,))[0] if isinstance(model_key, (list, tuple)) else DEFAULT_SOURCE
    from model.engine.presets import preset_by_name

    preset = preset_by_name(str(source))
    if preset is not None:
        size = preset.weight_bytes
    try:
        km = min(max(int(float(k_max)), 1), APP_MAX_K_MAX)
    except (TypeError, ValueError):
        km = APP_MAX_K_MAX
    tree = str(shape or "linear").strip().lower() not in ("linear", "")
    width = km * km if tree else 2 * km  # lossless feeds drafts + a block of masks per draft prefix
    per_pass = (GPU_PASS_SECONDS + size / GPU_READ_BYTES_PER_SECOND) * (1 + 0.01 * width)
    return int(min(GPU_SECONDS_MAX, max(15.0, GPU_SECONDS_OVERHEAD + 2 * n * per_pass)))


@dataclass(frozen=True)
class SideTiming:
    """One side's time by the page's one timing method (see :class:`SpeedEstimate`).

    Attributes:
        prefill: seconds of the first pass (the prompt).
        per_pass: seconds of the side's typical later pass (None: no later pass yet).
        passes: forward passes, the prefill included.
        tokens: tokens generated.
        seconds: ``prefill + (passes - 1) * per_pass``.
        measured: the plain sum of the side's own pass times (a different measure: load spikes included).
    """

    prefill: float
    per_pass: float | None
    passes: int
    tokens: int
    seconds: float
    measured: float

    @property
    def tokens_per_second(self) -> float:
        """``tokens / seconds`` (0 before any time)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def side_timing(records: Sequence[PassRecord], per_pass: float | None = None) -> SideTiming | None:
    """A side's :class:`SideTiming` with ``per_pass`` as its typical later pass (None: the median of its own
    later passes). None before the first pass."""
    if not records:
        return None
    decode = [r.seconds for r in records[1:]]
    if per_pass is None and decode:
        per_pass = statistics.median(decode)
    prefill = records[0].seconds
    seconds = prefill + (len(records) - 1) * (per_pass or 0.0)
    return SideTiming(prefill, per_pass, len(records), sum(len(r.kept) for r in records), seconds,
                      sum(r.seconds for r in records))


@dataclass(frozen=True)
class SpeedEstimate:
    """The MTP side's speed relative to standard decoding, robust to load: the page's one timing method.

    Every pass is timed alone (device synchronised, no pass of any other session beside it). A side's time
    is its prefill plus its other passes at its typical pass: the median of all the standard side's own decode
    passes (also those it ran after the MTP side had ended), and for MTP that median times the median ratio of
    paired passes (pass i of each side ran back to back, so load hits both alike; before any pair, the median
    of its own passes). ``ratio`` = (MTP tokens / MTP time) ÷ (standard tokens / standard time); with answers
    of equal length this is the wall-clock speedup.

    Attributes:
        ratio: > 1 faster, < 1 slower.
        low, high: 90% interval from resampling the standard side's decode passes and the paired decode passes
            (None: fewer than :data:`MIN_PAIRS_FOR_INTERVAL` pairs).
        pairs: paired decode passes used.
        pass_cost: median MTP decode pass time ÷ median standard decode pass time (None: no pairs).
        raw_ratio: the same ratio from the plain sums of the passes' seconds (a different measure).
        same_length: both answers have the same number of tokens.
        standard, mtp: each side's :class:`SideTiming` (what the counters show; ``ratio`` is the ratio of
            their tokens per second).
    """

    ratio: float
    low: float | None
    high: float | None
    pairs: int
    pass_cost: float | None
    raw_ratio: float
    same_length: bool
    standard: SideTiming | None = None
    mtp: SideTiming | None = None


#: Fewest paired decode passes for an interval.
MIN_PAIRS_FOR_INTERVAL = 5


def _timings(std: Sequence[PassRecord], mtp: Sequence[PassRecord], pairs: Sequence[tuple[float, float]]
             ) -> tuple[SideTiming, SideTiming, float | None]:
    """Both sides' timings from the given pairs, and the MTP/standard pass cost (None: no pairs)."""
    if pairs:
        d_std = statistics.median(r.seconds for r in std[1:])  # all of its own passes, not the paired ones only
        cost = statistics.median(m / s for s, m in pairs)
        return side_timing(std, d_std), side_timing(mtp, d_std * cost), cost  # type: ignore[return-value]
    return side_timing(std), side_timing(mtp), None  # type: ignore[return-value]


def _ratio(t_std: SideTiming, t_mtp: SideTiming) -> float:
    return t_mtp.tokens_per_second / t_std.tokens_per_second if t_std.tokens_per_second > 0 else 0.0


def estimate_speedup(std: Sequence[PassRecord], mtp: Sequence[PassRecord], *, resamples: int = 300,
                     seed: int = 0) -> SpeedEstimate | None:
    """The MTP side's speed relative to standard decoding (see :class:`SpeedEstimate`).

    Args:
        std, mtp: the two sides' pass records (pass 0 = prefill).
        resamples: bootstrap resamples of the paired decode passes for the interval.
        seed: the resampling's seed (the same records always give the same interval).

    Returns:
        None until both sides have run a pass that produced a token.
    """
    if not std or not mtp:
        return None
    n_std, n_mtp = sum(len(r.kept) for r in std), sum(len(r.kept) for r in mtp)
    raw_std, raw_mtp = sum(r.seconds for r in std), sum(r.seconds for r in mtp)
    if n_std == 0 or n_mtp == 0 or raw_std <= 0 or raw_mtp <= 0:
        return None
    pairs = [(s.seconds, m.seconds) for s, m in zip(std[1:], mtp[1:]) if s.seconds > 0 and m.seconds > 0]
    t_std, t_mtp, cost = _timings(std, mtp, pairs)
    ratio = _ratio(t_std, t_mtp)
    low = high = None
    if len(pairs) >= MIN_PAIRS_FOR_INTERVAL:  # the same method on resampled pairs (only the medians change)
        rng = random.Random(seed)
        later_std, later_mtp = len(std) - 1, len(mtp) - 1
        own = [r.seconds for r in std[1:]]

        def resampled() -> float:
            pick = [pairs[rng.randrange(len(pairs))] for _ in pairs]
            d_std = statistics.median(own[rng.randrange(len(own))] for _ in own)
            d_mtp = d_std * statistics.median(m / s for s, m in pick)
            return (n_mtp / (t_mtp.prefill + later_mtp * d_mtp)) / (n_std / (t_std.prefill + later_std * d_std))

        boot = sorted(resampled() for _ in range(resamples))
        low, high = boot[int(0.05 * (resamples - 1))], boot[int(round(0.95 * (resamples - 1)))]
    return SpeedEstimate(ratio=ratio, low=low, high=high, pairs=len(pairs), pass_cost=cost,
                         raw_ratio=(n_mtp / raw_mtp) / (n_std / raw_std), same_length=n_std == n_mtp,
                         standard=t_std, mtp=t_mtp)


# ---------------------------------------------------------------------------- quality beside speed
#: Repetition: the answer's last :data:`LOOP_SPAN` tokens or more repeat an n-gram of at most
#: :data:`LOOP_MAX_PERIOD` tokens, or its last :data:`DISTINCT_WINDOW` tokens hold fewer than
#: :data:`DISTINCT_FLOOR` distinct tokens per token.
LOOP_SPAN = 24
LOOP_MAX_PERIOD = 12
DISTINCT_WINDOW = 48
DISTINCT_FLOOR = 0.2


def repeats(token_ids: Sequence[int]) -> bool:
    """True when an answer degenerates into repetition: its last :data:`LOOP_SPAN` tokens (at least three
    periods) are one n-gram of at most :data:`LOOP_MAX_PERIOD` tokens repeated, or its last
    :data:`DISTINCT_WINDOW` tokens have a distinct-token ratio under :data:`DISTINCT_FLOOR`."""
    ids = list(token_ids)
    for period in range(1, LOOP_MAX_PERIOD + 1):
        span = max(LOOP_SPAN, 3 * period)
        if len(ids) >= span and all(ids[-j] == ids[-j - period] for j in range(1, span - period + 1)):
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
                  lock: threading.Lock = FORWARD_LOCK) -> Quality:
    """One scoring pass per answer (:func:`model.engine.scoring.teacher_nll`, adapter off) under ``lock``;
    a failure leaves that NLL None (logged), never an error in the page. Where the standard side ran the
    teacher's weights on every token (no adapter, or aLoRA), its KV cache holds the teacher's prompt: each
    pass then feeds the answer only, not the whole conversation again."""
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
    lock: threading.Lock = FORWARD_LOCK,
) -> Iterator[TurnState]:
    """Run a turn: standard decoding and ``turn.strategy`` on the same prompt, one pass each in turn.

    The two sides alternate in ABBA order (pair i runs standard first when i is even, MTP first
    when odd); each pass runs alone under ``lock``. The side that finishes first stops taking turns.

    Args:
        turn: from :func:`prepare_turn`.
        should_stop: polled before every pass; a reason (``"stopped"``, ``"cleared"``) ends the
            turn with that phase.
        lock: serialises forward passes across sessions.

    Yields:
        A :class:`TurnState` before the first pass and after every pass (``phase == "running"``),
        then one final state
        (``done``, ``stopped``, ``cleared`` or ``error``). Engine errors (context budget, NaN
        logits, anything else) become ``phase == "error"`` with a message; nothing is raised. A turn
        that ends done or stopped is scored first (:func:`score_answers`: one pass per answer, not timed):
        its final state carries :attr:`TurnState.quality`.
    """
    t0 = time.perf_counter()
    sides: dict[str, Decoder] = turn.sides

    def state(phase: str = "running", error: str | None = None, last: str | None = None) -> TurnState:
        std, mtp = sides["standard"].result(), sides["mtp"].result()
        quality = score_answers(turn, std, mtp, lock) if phase in ("done", "stopped") else None
        return TurnState(turn, std, mtp, sides["standard"].done, sides["mtp"].done, phase, error,
                         time.perf_counter() - t0, last, quality)

    yield state()  # the turn has started: no pass yet
    pair = 0
    while not all(d.done for d in sides.values()):
        order = ("standard", "mtp") if pair % 2 == 0 else ("mtp", "standard")
        for name in order:
            dec = sides[name]
            if dec.done:
                continue
            reason = should_stop()
            if reason:
                yield state(reason if reason in PHASES else "stopped")
                return
            try:
                with lock:
                    dec.run_pass()
            except NonFiniteLogitsError as e:
                yield state("error", str(e), name)
                return
            except Exception as e:  # noqa: BLE001 - the page shows a message and keeps serving
                log.exception("forward pass failed")
                yield state("error", f"The forward pass failed: {type(e).__name__}: {e}", name)
                return
            yield state(last=name)
        pair += 1
    yield state("done")


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


# ---------------------------------------------------------------------------- one run per session
#: Where Stop / Clear leave their flag for a run (one file per run). The generation may run in another
#: process (a ZeroGPU worker is a fork of this one): a file on the same machine reaches it there, which a
#: flag in this process's memory would not. Fixed at import, so forked workers share it.
STOP_DIR = Path(tempfile.gettempdir()) / f"mtp-lens-stop-{os.getpid()}"


def stop_requested(run_id: str) -> str | None:
    """``"stopped"`` / ``"cleared"`` once Stop / Clear reached run ``run_id`` (from any process), else None."""
    try:
        return (STOP_DIR / run_id).read_text().strip() or "stopped"
    except OSError:
        return None


class RunTicket:
    """The right to run one turn in a session; Stop and Clear reach the run through it.

    Attributes:
        run_id: names the run's stop flag (:func:`stop_requested`), for a generation in another process.
        session: the page session it belongs to.
        turn_number: set once the turn is prepared.
    """

    def __init__(self, runs: "SessionRuns", session: str):
        self._runs, self.session = runs, session
        self.run_id = uuid.uuid4().hex
        self._reason: str | None = None
        self.ended = threading.Event()
        self.turn_number: int | None = None
        self._conversation: list[dict] | None = None

    def stop_reason(self) -> str | None:
        """``"stopped"`` / ``"cleared"`` once Stop / Clear was pressed, else None (pass to run_turn)."""
        return self._reason

    def request_stop(self, reason: str = "stopped") -> None:
        """Ask the run to end before its next pass (Clear wins over Stop), in this process and in any
        other process that polls :func:`stop_requested`."""
        if self._reason != "cleared":
            self._reason = reason
        try:
            STOP_DIR.mkdir(parents=True, exist_ok=True)
            (STOP_DIR / self.run_id).write_text(self._reason or reason)
        except OSError as e:  # a read-only temp dir: the in-process flag still works
            log.warning("could not write the stop flag of run %s: %s", self.run_id, e)

    def record(self, history: list[dict]) -> None:
        """The conversation with this run's turn in it so far (its message and partial answers; the final one at
        its end): kept for the session when the run ends (:meth:`release`), in the same step, so that the next
        turn, which starts only then, continues it."""
        self._conversation = list(history)

    def release(self) -> None:
        """End the run (idempotent), recording its conversation first (:meth:`record`; none after Clear)."""
        self._runs._release(self)
        try:
            (STOP_DIR / self.run_id).unlink(missing_ok=True)
        except OSError:
            pass

    def __enter__(self) -> "RunTicket":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class SessionRuns:
    """At most one run per session at a time, and each session's conversation as the server saw it end.

    :meth:`begin` returns a :class:`RunTicket` or None while the session's previous run is still
    going (the page then refuses the new message with a reason, keeping it in the box). A run asked
    to stop ends before its next forward pass, so :meth:`begin` waits a moment for it. The
    conversation after each turn is kept here, recorded by the run itself as it ends (:meth:`RunTicket.record`,
    in the same step as its end: however it ends, its message and partial answers are kept before the next turn
    may start), so that a message sent right after Stop continues the stopped turn even when the page has not
    yet received it (:meth:`conversation`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, RunTicket] = {}
        self._conversations: OrderedDict[str, list[dict]] = OrderedDict()
        self._points: OrderedDict[str, list[dict]] = OrderedDict()

    def begin(self, session: str | None, wait_if_stopping: float = 10.0, wait_for_stop: float = 0.0
              ) -> RunTicket | None:
        """A ticket for a new run in ``session`` (None: no session, never refused), or None if busy.

        Args:
            wait_if_stopping: seconds to wait for a run that was asked to stop to end.
            wait_for_stop: seconds to wait for a Stop that may still be on its way (a message sent right after
                Stop travels apart from it) before refusing a session whose run is going on.
        """
        if session is None:
            return RunTicket(self, f"anonymous-{uuid.uuid4().hex}")
        start = time.monotonic()
        deadline = start + wait_if_stopping
        while True:
            with self._lock:
                cur = self._runs.get(session)
                if cur is None:
                    ticket = self._runs[session] = RunTicket(self, session)
                    return ticket
            now = time.monotonic()
            if cur.stop_reason() is None:
                if now - start >= wait_for_stop:
                    return None
                cur.ended.wait(timeout=min(0.05, wait_for_stop - (now - start)))
                continue
            if now >= deadline:
                return None
            cur.ended.wait(timeout=max(0.0, deadline - now))

    def current(self, session: str | None) -> RunTicket | None:
        """The session's running ticket, if any."""
        with self._lock:
            return self._runs.get(session) if session is not None else None

    def request_stop(self, session: str | None, reason: str = "stopped") -> bool:
        """Ask the session's run to end (``"stopped"`` or ``"cleared"``); False if none runs."""
        ticket = self.current(session)
        if ticket is None:
            return False
        ticket.request_stop(reason)
        return True

    def remember(self, session: str | None, history: list[dict]) -> None:
        """Keep the session's conversation after a turn (or Clear); the oldest sessions go first."""
        if session is None:
            return
        with self._lock:
            self._keep(session, history)

    def _keep(self, session: str, history: list[dict]) -> None:
        """:meth:`remember` with the lock held."""
        self._conversations[session] = list(history)
        self._conversations.move_to_end(session)
        while len(self._conversations) > MAX_SESSIONS_KEPT:
            self._conversations.popitem(last=False)

    def conversation(self, session: str | None, sent: list[dict]) -> list[dict]:
        """The conversation a new turn continues: what the page sent, unless the server's record of this
        session is longer and starts with it (the page had not yet shown the last turn's end)."""
        with self._lock:
            known = self._conversations.get(session) if session is not None else None
        if known is not None and len(known) > len(sent) and _same_messages(known[: len(sent)], sent):
            return list(known)
        return sent

    def add_point(self, session: str | None, point: dict) -> None:
        """Keep a finished answer's point for the session's trade-off figure (:func:`answer_point`)."""
        if session is None:
            return
        with self._lock:
            points = self._points.setdefault(session, [])
            points.append(dict(point))
            del points[:-MAX_POINTS_KEPT]
            self._points.move_to_end(session)
            while len(self._points) > MAX_SESSIONS_KEPT:
                self._points.popitem(last=False)

    def points(self, session: str | None, model_key: Sequence[str] | None = None) -> list[dict]:
        """The session's answer points, oldest first (those of ``model_key`` only, when given)."""
        with self._lock:
            points = list(self._points.get(session, [])) if session is not None else []
        if model_key is not None:
            points = [p for p in points if tuple(p.get("model_key", ())) == tuple(model_key)]
        return points

    def _release(self, ticket: RunTicket) -> None:
        """Record the run's conversation and end it in one step: a turn waiting in :meth:`begin` starts only
        once both are done."""
        with self._lock:
            if self._runs.get(ticket.session) is ticket:
                if ticket.stop_reason() == "cleared":
                    self._keep(ticket.session, [])
                elif ticket._conversation is not None:
                    self._keep(ticket.session, ticket._conversation)
                ticket._conversation = None
                del self._runs[ticket.session]
        ticket.ended.set()


#: Conversations the server keeps (one per recent session).
MAX_SESSIONS_KEPT = 256
#: Answer points kept per session (the trade-off figure).
MAX_POINTS_KEPT = 200


def answer_point(state: TurnState) -> dict | None:
    """A finished turn as a point of the trade-off figure: ``{"model_key", "turn", "label", "name", "tau",
    "effective_k", "identical", "parted_at", "nll", "standard_nll", "repeats"}`` (plain values). None unless
    the turn is done and both answers were scored."""
    q = state.quality
    if state.phase != "done" or q is None or q.mtp_nll is None:
        return None
    return {"model_key": list(state.turn.model_key), "turn": state.turn.number, "label": state.strategy.label,
            "name": state.strategy.name, "tau": state.strategy.tau, "effective_k": state.mtp.effective_k,
            "identical": state.identical, "parted_at": state.parted_at, "nll": q.mtp_nll,
            "standard_nll": q.standard_nll, "repeats": q.mtp_repeats}


def _same_messages(a: Sequence[dict], b: Sequence[dict]) -> bool:
    return [(m["role"], m["content"]) for m in a] == [(m["role"], m["content"]) for m in b]
