"""What the loaded checkpoint trades on this device, without any Gradio type (paper 4.5).

* :class:`WidthProfile` — what a forward pass costs here by how many tokens it feeds
  (:func:`model.engine.width.pass_costs`, measured once per model under the app's forward lock).
  MTP pays off only where a pass over several tokens costs about what a one-token pass costs.
* :class:`LosslessShape` — the lossless setting (k_max and where the mask blocks go) that decodes
  fastest here: :func:`model.engine.width.choose_verify_layout` from the width profile and the
  checkpoint's acceptance by draft position (its sweep, or a stated default).
* :class:`ModelFacts` — both, and the checkpoint's speed/quality sweep over tau
  (:mod:`model.evaluation.sweep`: shipped as ``sweep.json`` beside the adapter, or measured on the
  example prompts by the page's button), cached per model key.

No model code lives here: the engine measures and decodes; this module keeps its answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import statistics
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from model.engine.loaded_model import LoadedModel
from model.engine.precision import native_bf16
from model.engine.strategies import Verify, confadapt, verify
from model.engine.width import (DEFAULT_ACCEPTANCE, AutoWidth, WidthCosts, choose_verify_layout,
                                conditional_acceptance, pass_times)
from model.evaluation.sweep import Sweep, load_sweep, run_sweep, verify_acceptance

log = logging.getLogger(__name__)

#: Rounds when the profile is measured (each round: every width once, after one warm-up each): one round under
#: a burst of load skews its ratios, the median of seven does not.
WIDTH_REPEATS = 7
#: The lossless shapes the page offers: the fastest for this device, or a fixed layout at the k_max box.
SHAPE_CHOICES = ("fastest here", "linear", "full tree")
#: The page's "Measure the trade-off" sweep: ConfAdapt at these taus, lossless, 48 new tokens per answer.
SWEEP_TAUS = (0.5, 0.7, 0.9, 0.99)
SWEEP_MAX_NEW_TOKENS = 48
#: Largest k_max a measured sweep uses (the model's own k_max when smaller).
SWEEP_K_MAX = 8
#: Models whose facts (width profile, sweeps) :class:`ModelFacts` keeps, the least recently used forgotten first:
#: every source ever loaded would otherwise leave its facts behind. Well above the registry's capacity, so that a
#: model loaded again soon finds its width profile and a sweep measured on the page (minutes) is kept.
MAX_FACTS_KEPT = 16


@dataclass(frozen=True)
class WidthProfile:
    """Seconds of one forward pass by tokens fed, measured on the model's device.

    Attributes:
        costs: ``{tokens fed: seconds}`` (:func:`model.engine.width.pass_costs`).
        device: the device, e.g. ``"cpu"``, ``"cuda:0"``.
        dtype: the dtype the weights compute in, e.g. ``"float32"``.
        native_bf16: the device computes bfloat16 natively (:func:`model.engine.precision.native_bf16`).
        seconds: how long the measurement took.
    """

    costs: dict
    device: str
    dtype: str
    native_bf16: bool
    seconds: float = 0.0
    ratios: WidthCosts = dataclasses.field(default_factory=WidthCosts, compare=False)

    def __post_init__(self) -> None:
        if self.ratios.widths() == [1] and self.costs.get(1):  # given seconds only: their ratios, one pair each
            for w, c in self.costs.items():
                self.ratios.observe(w, c / self.costs[1])

    @classmethod
    def measure(cls, lm: LoadedModel) -> "WidthProfile":
        """Measure ``lm``'s width cost now (:func:`~model.engine.width.pass_times`, :data:`WIDTH_REPEATS` rounds)."""
        t0 = time.perf_counter()
        times = pass_times(lm, repeats=WIDTH_REPEATS)
        costs = {w: statistics.median(ts) for w, ts in times.items()}
        return cls(costs, str(lm.device), lm.dtype_name, native_bf16(lm.device), time.perf_counter() - t0,
                   WidthCosts.from_rounds(times))

    def ratio(self, width: int) -> float:
        """Cost of a pass of ``width`` tokens ÷ cost of a one-token pass: the median of the ratios of passes run
        back to back (:class:`~model.engine.width.WidthCosts`: measured, then refreshed by the page's own passes)."""
        return self.ratios.ratio(width)

    def spread(self, width: int) -> tuple[float, float] | None:
        """The middle half of the ratios at ``width`` (None with fewer than 4)."""
        return self.ratios.spread(width)

    @property
    def slow_width(self) -> bool:
        """A CPU without native bf16: MTP's wider passes cost well over a one-token pass here."""
        return self.device.startswith("cpu") and not self.native_bf16

    def to_dict(self) -> dict:
        """Plain JSON (widths as strings)."""
        return {"costs": {str(k): v for k, v in self.costs.items()}, "device": self.device, "dtype": self.dtype,
                "native_bf16": self.native_bf16, "seconds": self.seconds, "ratios": self.ratios.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "WidthProfile":
        """Inverse of :meth:`to_dict`."""
        costs = {int(k): float(v) for k, v in d["costs"].items()}
        ratios = WidthCosts.from_dict(d["ratios"]) if d.get("ratios") else WidthCosts()
        return cls(costs, d["device"], d["dtype"], bool(d["native_bf16"]), float(d.get("seconds", 0.0)), ratios)


@dataclass(frozen=True)
class LosslessShape:
    """The fastest lossless setting for a device and a checkpoint, within a k_max limit.

    Attributes:
        k_max: proposals per pass (1: standard decoding itself: no draft pays for its width here).
        blocks: the draft prefixes a block of masks follows (None: the linear layout).
        speedup: expected tokens per second relative to standard decoding (1.0 for k_max 1).
        acceptance: the acceptance by draft position the choice used (share of passes that accepted
            draft j, as :attr:`~model.engine.decoding.GenerationResult.acceptance_by_position`).
        source: where that acceptance comes from, in words.
        limit: the k_max limit (the page's k_max box).
    """

    k_max: int
    blocks: tuple | None
    speedup: float
    acceptance: tuple
    source: str
    limit: int

    @property
    def strategy(self) -> Verify:
        """The engine's strategy for this shape."""
        return Verify(k_max=self.k_max, blocks=self.blocks)

    @property
    def layout(self) -> str:
        """``linear``, ``full`` or the prefixes a block follows (``0/1/3``)."""
        return self.strategy.layout

    def describe(self) -> str:
        """The shape in words, e.g. ``k_max 3, mask blocks after 0/2 drafts``."""
        if self.k_max <= 1:
            return "k_max 1 (standard decoding itself)"
        lay = self.layout
        where = "one block after the drafts (linear)" if lay == "linear" else (
            "a block after every draft prefix (full tree)" if lay == "full" else f"mask blocks after {lay} drafts")
        return f"k_max {self.k_max}, {where}"


def _verify_points(sweep: Sweep | None) -> list[int]:
    """k_max of the sweep's linear lossless points, largest first."""
    return sorted({p.k_max for p in sweep.named("verify") if p.linear_verify} if sweep else set(), reverse=True)


class _LockedModel(LoadedModel):
    """A view of a :class:`LoadedModel` (same weights, same fast-path structures) whose every forward
    pass, and every pass of the teacher (adapter off), runs under a lock: a sweep measured while other
    sessions generate neither overlaps their timed passes nor switches their adapter off."""

    _app_lock: Any = None
    _holding: Any = None  # threading.local(): how deeply this thread is inside _locked

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The app's lock, taken once by a thread however deeply it nests: the teacher's pass
        (:meth:`forward_batch`) runs inside :meth:`base_model`, which already holds it."""
        depth = getattr(self._holding, "depth", 0)
        with contextlib.nullcontext() if depth else self._app_lock:
            self._holding.depth = depth + 1
            try:
                yield
            finally:
                self._holding.depth = depth

    def forward_batch(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - every pass's entry, under the lock
        with self._locked():
            return super().forward_batch(*args, **kwargs)

    @contextlib.contextmanager
    def base_model(self) -> Iterator[Any]:  # noqa: D102 - LoadedModel.base_model under the lock
        with self._locked():
            with super().base_model() as model:
                yield model


def locked_view(lm: LoadedModel, lock: Any) -> LoadedModel:
    """``lm`` with every forward pass (and the teacher's) taken under ``lock`` (see :class:`_LockedModel`).

    A workaround: the engine's :func:`~model.evaluation.sweep.run_sweep` has no hook for a lock per pass."""
    view = _LockedModel(**{f.name: getattr(lm, f.name) for f in dataclasses.fields(lm) if f.init})
    view._app_lock, view._holding = lock, threading.local()
    return view


class ModelFacts:
    """Width profiles and sweeps of the loaded models, cached per model key ``(source, quantization, precision)``,
    for at most :data:`MAX_FACTS_KEPT` models (the least recently used forgotten first).

    Args:
        lock: the app's forward lock (:func:`app.passes.exclusive`): the width measurement holds it, so
            that no other pass runs beside it; a sweep takes it pass by pass.
    """

    def __init__(self, lock: Any):
        self._lock = lock
        self._mutex = threading.Lock()
        self._profiles: dict[tuple, WidthProfile | None] = {}
        self._profile_errors: dict[tuple, str] = {}
        self._shipped: dict[tuple, Sweep | None] = {}
        self._measured: dict[tuple, Sweep] = {}
        self._auto: dict[tuple, AutoWidth] = {}
        self._recent: OrderedDict[tuple, None] = OrderedDict()  # the keys above, least recently used first

    def _touch(self, key: tuple) -> None:
        """Mark ``key`` used (with the mutex held); forget the least recently used models past
        :data:`MAX_FACTS_KEPT`."""
        self._recent[key] = None
        self._recent.move_to_end(key)
        while len(self._recent) > MAX_FACTS_KEPT:
            old, _ = self._recent.popitem(last=False)
            for facts in (self._profiles, self._profile_errors, self._shipped, self._measured, self._auto):
                facts.pop(old, None)

    def kept(self) -> list[tuple]:
        """The model keys whose facts are kept, least recently used first."""
        with self._mutex:
            return list(self._recent)

    # ------------------------------------------------------------------ width
    def profile(self, key: tuple, lm: LoadedModel | None = None) -> WidthProfile | None:
        """The width profile of model ``key``: cached, or measured now on ``lm`` (a few seconds, holding the
        forward lock) when ``lm`` is given. None when not measured (or the measurement failed:
        :meth:`profile_error` says why)."""
        with self._mutex:
            if key in self._profiles:
                self._touch(key)
                return self._profiles[key]
        if lm is None:
            return None
        try:
            with self._lock:
                prof = WidthProfile.measure(lm)
        except Exception as e:  # noqa: BLE001 - a model the measurement cannot run: the page says so
            log.exception("measuring the width cost of %s failed", key)
            with self._mutex:
                self._profile_errors[key] = f"{type(e).__name__}: {e}"
                self._profiles[key] = None
                self._touch(key)
            return None
        with self._mutex:
            self._profiles[key] = prof
            self._touch(key)
        return prof

    def put_profile(self, key: tuple, profile: WidthProfile | None) -> None:
        """Record a profile measured elsewhere (a GPU worker process)."""
        if profile is not None:
            with self._mutex:
                self._profiles[key] = profile
                self._touch(key)

    def observe(self, key: tuple, pairs: Sequence[tuple[int, float]]) -> None:
        """Refresh model ``key``'s width cost with the page's own passes: ``(tokens fed by an MTP pass, its time
        over the standard pass run beside it)`` pairs; the choices of ``verify:auto`` follow."""
        with self._mutex:
            prof = self._profiles.get(key)
            if prof is None:
                return
            for width, ratio in pairs:
                prof.ratios.observe(width, ratio)
            policy = self._auto.get(key)
            if policy is not None and pairs:
                policy._memo.clear()

    def auto_width(self, key: tuple, lm: LoadedModel) -> AutoWidth | None:
        """The :class:`~model.engine.width.AutoWidth` that lossless "fastest here" turns of model ``key`` decide
        each pass with: this device's width cost and the checkpoint's acceptance (None without a profile)."""
        prof = self.profile(key)
        if prof is None:
            return None
        acc, _ = self.acceptance(key, lm)
        with self._mutex:
            policy = self._auto.get(key)
            if policy is None or policy.costs is not prof.ratios or tuple(policy.prior) != tuple(acc):
                policy = self._auto[key] = AutoWidth(prof.ratios, acc)
            return policy

    def profile_error(self, key: tuple) -> str | None:
        """Why the width profile of ``key`` could not be measured, if it failed."""
        return self._profile_errors.get(key)

    # ------------------------------------------------------------------ sweeps
    def sweep(self, key: tuple, lm: LoadedModel | None) -> tuple[Sweep | None, str | None]:
        """``(sweep, source)``: the checkpoint's shipped ``sweep.json`` (source ``"shipped"``), else one
        measured by the page (``"measured"``), else ``(None, None)``."""
        with self._mutex:
            known = key in self._shipped
            shipped = self._shipped.get(key)
            if known:
                self._touch(key)
        if not known and lm is not None:
            shipped = load_sweep(getattr(lm, "checkpoint_dir", None))
            with self._mutex:
                self._shipped[key] = shipped
                self._touch(key)
        if shipped is not None:
            return shipped, "shipped"
        with self._mutex:
            measured = self._measured.get(key)
        return (measured, "measured") if measured is not None else (None, None)

    def put_sweep(self, key: tuple, sweep: Sweep) -> None:
        """Keep a sweep measured by the page for model ``key``."""
        with self._mutex:
            self._measured[key] = sweep
            self._touch(key)

    def acceptance(self, key: tuple, lm: LoadedModel) -> tuple[tuple, str]:
        """``(acceptance by draft position, where it comes from)``: the sweep's lossless point with the largest
        k_max, else :data:`DEFAULT_ACCEPTANCE` (none for a model whose mask token is untrained)."""
        sweep, source = self.sweep(key, lm)
        for k in _verify_points(sweep):
            by_pos = verify_acceptance(sweep, k)
            if by_pos:
                what = "the checkpoint's sweep" if source == "shipped" else "the trade-off measured here"
                return tuple(0.0 if a is None else float(a) for a in by_pos), f"{what} (lossless k_max {k})"
        if not lm.mtp_trained:
            return (0.0,), "none expected: the model is not MTP-trained"
        return DEFAULT_ACCEPTANCE, "assumed (no sweep for this checkpoint yet)"

    def shape(self, key: tuple, lm: LoadedModel, limit: int, *, measure: bool = True) -> LosslessShape | None:
        """The fastest lossless setting with k_max ≤ ``limit`` on this device (None without a width
        profile; measured now when ``measure``)."""
        prof = self.profile(key, lm if measure else None)
        if prof is None:
            return None
        acc, source = self.acceptance(key, lm)
        k, blocks, speedup = choose_verify_layout(prof.ratios.costs(), conditional_acceptance(acc), max(1, int(limit)))
        return LosslessShape(k, blocks, speedup, acc, source, int(limit))

    # ------------------------------------------------------------------ measuring a sweep
    def measure_sweep(self, key: tuple, lm: LoadedModel, prompts: Sequence[str], *,
                      taus: Sequence[float] = SWEEP_TAUS, max_new_tokens: int = SWEEP_MAX_NEW_TOKENS,
                      on_progress: Callable[[int, int], None] | None = None) -> Sweep:
        """Measure the trade-off on ``prompts`` with :func:`~model.evaluation.sweep.run_sweep` (ConfAdapt at
        ``taus`` and lossless, at the model's k_max up to :data:`SWEEP_K_MAX`), every pass under the forward
        lock; keep and return it.

        Raises:
            ValueError: no prompts.
        """
        if not prompts:
            raise ValueError("No prompts to measure the trade-off on.")
        k = max(2, min(lm.default_k_max, SWEEP_K_MAX))
        strategies = [confadapt(t, k) for t in taus] + [verify(k)]
        sweep = run_sweep(locked_view(lm, self._lock), list(prompts), strategies, max_new_tokens=max_new_tokens,
                          on_progress=on_progress)
        self.put_sweep(key, sweep)
        return sweep


def progress_of(fn: Callable[[Callable[[int, int], None]], Any]) -> Iterator[tuple[str, Any]]:
    """Run ``fn(on_progress)`` in a thread and yield ``("progress", (done, total))`` as it reports, then
    ``("result", value)`` or ``("error", exception)``: a long engine call as a generator (what a ZeroGPU
    worker can stream back)."""
    q: queue.Queue = queue.Queue()

    def work() -> None:
        try:
            q.put(("result", fn(lambda done, total: q.put(("progress", (done, total))))))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            q.put(("error", e))

    threading.Thread(target=work, daemon=True).start()
    while True:
        kind, value = q.get()
        yield kind, value
        if kind != "progress":
            return
