"""The models the page serves: loaded once, cached per ``(source, quantization, precision)``, with what each
trades on this device (:class:`app.device.ModelFacts`)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable

from model.engine.loaded_model import LoadedModel
from model.engine.loading import DEFAULT_SOURCE, load_checkpoint
from model.errors import CheckpointError, KernelError, RequestError

from .device import ModelFacts
from .passes import exclusive
from .requests import PRECISIONS, QUANTIZATIONS

log = logging.getLogger(__name__)

#: Models kept loaded (least recently used first out). What one costs on the CPU, measured (defect 6): the default
#: SmolLM2-135M + adapter in bfloat16 ~0.9 GB of the process (weights 294 MB, most of them the checkpoint file
#: mapped; our kernels' packed copy 304 MB; its tokenizer and width profile), its float32 copy ~1.4 GB more
#: (550 MB of weights and 550 MB packed): the page with both ~2.7 GB, ~0.4 GB of it the libraries.
CAPACITY = 2


class ModelRegistry:
    """Models loaded once and cached per ``(source, quantization, precision)`` (least recently used first out),
    with what each trades on this device (:attr:`facts`: width profile, lossless shape, sweep).

    Args:
        loader: the engine's :func:`model.engine.loading.load_checkpoint` (or a compatible callable).
        capacity: how many models stay loaded (:data:`CAPACITY`).
        lock: what the width and trade-off measurements hold pass by pass (the page's pass lock,
            :func:`app.passes.exclusive`, by default).
    """

    def __init__(self, loader: Callable[..., LoadedModel] = load_checkpoint, capacity: int = CAPACITY,
                 lock: threading.Lock | None = None):
        self._loader = loader
        self._capacity = max(1, capacity)
        #: Width profiles and sweeps of the models, per key (:class:`app.device.ModelFacts`).
        self.facts = ModelFacts(lock if lock is not None else exclusive())
        self._models: OrderedDict[tuple[str, str, str], LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        # A lock per key being loaded, and how many requests hold or wait for it: dropped when none does, so that
        # every source ever asked for (a mistyped one too) does not leave a lock behind.
        self._loading: dict[tuple[str, str, str], list] = {}

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
            entry = self._loading.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                return self._load(key)
        finally:
            with self._lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._loading[key]

    def _load(self, key: tuple[str, str, str]) -> LoadedModel:
        """:meth:`get`'s load, with the key's lock held."""
        with self._lock:
            if key in self._models:  # loaded by another request meanwhile
                return self._models[key]
        try:
            lm = self._loader(key[0], quantization=None if key[1] == "none" else key[1], dtype=key[2])
        except CheckpointError as e:  # the user's choice: a message in the page
            raise RequestError(str(e)) from None
        except KernelError as e:  # the server's setting (MTP_KERNELS): the page and the server's log say so
            log.warning("loading %s failed: %s", key[0], e)
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
