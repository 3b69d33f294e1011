"""The bench's measurements of single forward passes (:func:`model.evaluation.speed.bench`, items 2 to 4 of its
module docstring): milliseconds per pass by tokens fed (:func:`width_curve`, our kernels beside the torch fast path:
:func:`torch_path_view`, and a pass called from another thread as the app calls it), rows of a pass bit-identical
to one-token passes (:func:`row_exactness_report`), and the weight bytes a pass reads against the device's measured
memory bandwidth (:func:`pass_bytes`, :func:`read_bandwidth`).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any, Sequence

import torch

from ..engine.decoding import sync
from ..engine.loaded_model import LoadedModel
from ..engine.width import DEFAULT_WIDTHS, WIDTH_PROMPT


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters, each shared tensor (tied embeddings) counted once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def pass_bytes(model: Any) -> int:
    """Bytes a 1-token forward pass reads: every parameter once, except an input embedding that is
    not tied to the output embedding (a pass reads one of its rows, not all of it)."""
    total = weight_bytes(model)
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (out is None or out.weight.data_ptr() != emb.weight.data_ptr()):
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> tuple[float, str]:
    """Measured memory bandwidth in bytes/s and how it was measured: on CUDA a device-to-device copy of
    ``nbytes`` ((read + write) bytes / seconds), elsewhere the sum of an ``nbytes`` float32 tensor
    (bytes read / seconds; one pass over memory, the threads torch uses). Median of ``repeats``."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    cuda = device.type == "cuda"
    y = torch.empty_like(x) if cuda else None
    times = []
    for i in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        if cuda:
            y.copy_(x)  # type: ignore[union-attr]
        else:
            x.sum()
        sync(device)
        if i:  # the first run warms up
            times.append(time.perf_counter() - t0)
    del x, y
    if cuda:
        return 2 * nbytes / statistics.median(times), "device copy of 1 GiB (read + write)"
    return nbytes / statistics.median(times), "sum of a 1 GiB float32 tensor (read)"


@torch.inference_mode()
def torch_path_view(lm: LoadedModel) -> LoadedModel | None:
    """A view of ``lm`` on the torch fast path (``MTP_KERNELS=off``: oneDNN / MKL / SDPA), to time beside our
    kernels in one process; None when ``lm`` does not run on our kernels."""
    from ..engine.loaded_model import _FastState

    if lm.backend().kind != "kernels":
        return None
    old = os.environ.get("MTP_KERNELS")
    os.environ["MTP_KERNELS"] = "off"
    try:
        view = dataclasses.replace(lm, _fast=_FastState())
        view.fast_engine()
    finally:
        if old is None:
            os.environ.pop("MTP_KERNELS", None)
        else:
            os.environ["MTP_KERNELS"] = old
    return view if view.fast_engine() is not None else None


def row_exactness_report(lm: LoadedModel, widths: Sequence[int] = (2, 4, 8, 16), prompt: str = WIDTH_PROMPT
                         ) -> list[dict] | None:
    """Rows of a pass bit-identical to one-token passes (:func:`model.engine.exactness.row_exactness`), by
    width: MTP passes (1 real token + masks, adapter on) and passes of real tokens. None off the fast path."""
    from ..engine.exactness import row_exactness
    if lm.backend().kind == "library":
        return None
    ids = lm.prompt_ids(prompt)
    real = [t for t in ids if t != lm.mask_token_id] or [0]
    out = []
    for t in widths:
        if t < 2:
            continue
        mtp = row_exactness(lm, ids, [real[-1]] + [lm.mask_token_id] * (t - 1), num_masks=t - 1)
        plain = row_exactness(lm, ids, (real * 64)[:t])
        out.append({"width": t, "mtp_equal": mtp.equal, "real_equal": plain.equal,
                    "max_abs_diff": max(mtp.max_abs_diff, plain.max_abs_diff)})
    return out


class _WorkerThread:
    """A long-lived thread that runs calls handed to it, as the app's pass loop runs the page's passes; each call
    is timed on that thread (the hand-over is not counted), with the caller's torch thread count."""

    def __init__(self) -> None:
        import queue
        import threading

        self._jobs: Any = queue.Queue()
        self._done: Any = queue.Queue()
        threads = torch.get_num_threads()

        def loop() -> None:
            torch.set_num_threads(threads)
            while (job := self._jobs.get()) is not None:
                t0 = time.perf_counter()
                job()
                self._done.put(time.perf_counter() - t0)

        self._thread = threading.Thread(target=loop, name="bench-worker", daemon=True)
        self._thread.start()

    def call(self, fn: Any) -> float:
        """Run ``fn()`` on the worker thread; returns its seconds there."""
        self._jobs.put(fn)
        return self._done.get()

    def close(self) -> None:
        """End the thread."""
        self._jobs.put(None)
        self._thread.join()


def width_prompt(lm: LoadedModel, context_tokens: int = 0, widest: int = 64) -> str:
    """The prompt the width curve caches before its passes: :data:`~model.engine.width.WIDTH_PROMPT`, repeated until
    ``lm`` tokenizes it into at least ``context_tokens`` tokens (0: once; at most one repetition more). A longer
    cache weighs attention, which reads every cached key and value per query row, against the weights' read.
    ``widest``: the most tokens a pass of the curve feeds after it.

    Raises:
        ValueError: ``context_tokens`` not an integer >= 0, or more than the model's positions leave for the
            prompt's last repetition and a ``widest``-token pass.
    """
    once, twice = len(lm.prompt_ids(WIDTH_PROMPT)), len(lm.prompt_ids(WIDTH_PROMPT + " " + WIDTH_PROMPT))
    step, limit = max(1, twice - once), lm.max_positions
    most = None if limit is None else limit - widest - step
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 0 or (
            most is not None and context_tokens > most):
        bound = "" if most is None else (f" and at most {most} (this model's {limit} positions less a {widest}-token "
                                         f"pass and one more repetition of the prompt)")
        raise ValueError(f"the width curve's context (--width-context) must be an integer ≥ 0{bound}, "
                         f"got {context_tokens!r}.")
    repeats = 1 + max(0, -(-(context_tokens - once) // step))  # from the tokens one more repetition adds
    while len(lm.prompt_ids(prompt := " ".join([WIDTH_PROMPT] * repeats))) < context_tokens:
        repeats += 1
    return prompt


def width_curve(lm: LoadedModel, plain: LoadedModel, widths: Sequence[int] = DEFAULT_WIDTHS, repeats: int = 15,
                prompt: str = WIDTH_PROMPT, before: LoadedModel | None = None) -> dict:
    """Milliseconds per forward pass by tokens fed, over a cached prompt (see the module docstring).

    ``before``: a view of the same model on the torch fast path (:func:`torch_path_view`): its MTP pass is timed
    beside ours (before / after our kernels, in one process).

    Returns:
        ``{"context_tokens", "widths", "rows": [{"name", "label", "ms": [median per width],
        "ratio": [ms / ours_base at width 1]}]}``; ``ours_adapter`` only when ``lm`` has an adapter;
        ``ours_worker_thread``: our pass (with the adapter when there is one) called from another thread, as the
        app calls it.
    """
    from transformers import DynamicCache

    ids = lm.prompt_ids(prompt)
    dev, mask = lm.device, lm.mask_token_id
    real = [t for t in ids if t != mask] or [0]

    def tokens(n_real: int, n_masks: int) -> torch.Tensor:
        return torch.tensor([(real * 16)[:n_real] + [mask] * n_masks], dtype=torch.long, device=dev)

    def hf_pass(cache: Any, t: int) -> None:
        plain.model(input_ids=tokens(t, 0), past_key_values=cache, use_cache=True, logits_to_keep=t)
        cache.crop(-t)

    def ours(cache: Any, t: int, with_adapter: bool) -> None:
        m = t - 1 if with_adapter else 0
        lm.forward(tokens(t - m, m), cache, num_masks=m, logits_to_keep=t)
        cache.crop(-t)

    hf_cache = DynamicCache(config=plain.model.config)
    plain.model(input_ids=torch.tensor([ids], device=dev), past_key_values=hf_cache, use_cache=True, logits_to_keep=1)
    our_cache = lm.new_cache()
    lm.forward(torch.tensor([ids], device=dev), our_cache, num_masks=0, logits_to_keep=1)
    methods: list[tuple[str, str, Any]] = [
        ("hf_plain", "transformers forward, plain base", lambda t: hf_pass(hf_cache, t)),
        ("ours_base", "ours, base weights (T real tokens)", lambda t: ours(our_cache, t, False)),
    ]
    if lm.adapter is not None:
        methods.append(("ours_adapter", "ours + adapter (1 real + T-1 masks)", lambda t: ours(our_cache, t, True)))
    if before is not None:
        old_cache = before.new_cache()
        before.forward(torch.tensor([ids], device=dev), old_cache, num_masks=0, logits_to_keep=1)

        def old_pass(t: int) -> None:
            m = t - 1 if lm.adapter is not None else 0
            before.forward(tokens(t - m, m), old_cache, num_masks=m, logits_to_keep=t)
            old_cache.crop(-t)

        methods.append(("torch_path", "torch path (MTP_KERNELS=off), "
                        + ("1 real + T-1 masks" if lm.adapter is not None else "T real tokens"), old_pass))
    worker = _WorkerThread()  # the page's passes run on a thread of their own: timed beside the main thread's
    thread_cache = lm.new_cache()
    worker.call(lambda: lm.forward(torch.tensor([ids], device=dev), thread_cache, num_masks=0, logits_to_keep=1))
    thread_label = ("ours + adapter, called from a worker thread" if lm.adapter is not None
                    else "ours, called from a worker thread")
    methods.append(("ours_worker_thread", thread_label,
                    lambda t: worker.call(lambda: ours(thread_cache, t, lm.adapter is not None))))
    ms = _pass_ms(methods, widths, repeats, dev)
    worker.close()
    ref = ms["ours_base"][0] if widths and widths[0] == 1 else None
    rows = [{"name": name, "label": label, "ms": ms[name],
             "ratio": [v / ref for v in ms[name]] if ref else None} for name, label, _ in methods]
    return {"context_tokens": len(ids), "widths": list(widths), "rows": rows}


def _pass_ms(methods: Sequence[tuple[str, str, Any]], widths: Sequence[int], repeats: int,
             dev: torch.device) -> dict[str, list[float]]:
    """Milliseconds per pass of each method by width, ``{name: [median per width]}``: ``methods`` are
    ``(name, label, f)``, ``f(t)`` one pass over ``t`` tokens (returning its own seconds, or None to be timed here,
    device synchronised); at each width one warm-up pass per method, then ``repeats`` rounds, the order of methods
    rotating from one round to the next."""
    ms: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    for t in widths:
        times: dict[str, list[float]] = {name: [] for name, _, _ in methods}
        for _, _, f in methods:
            f(t)  # warm-up at this width
        for r in range(repeats):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for name, _, f in order:
                sync(dev)
                t0 = time.perf_counter()
                inner = f(t)
                sync(dev)
                times[name].append(inner if isinstance(inner, float) else time.perf_counter() - t0)
        for name in ms:
            ms[name].append(1e3 * statistics.median(times[name]))
    return ms
