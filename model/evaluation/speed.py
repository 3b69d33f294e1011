"""Wall-clock benchmark: decoding speed against HF ``generate``, and the cost of a forward pass by width.

:func:`bench` (command line: ``python -m model.bench``) runs everything in one process, methods
alternating, medians over repeats:

1. **Tokens per second** of HF ``generate`` (greedy) on the *plain base model* — what a user would run:
   the base without any peft wrapper, in the same dtype —, of llama.cpp's greedy decoding of the same
   weights when llama-cpp-python is installed (:mod:`model.evaluation.llama_cpp`: the fastest plain
   decoder on a CPU), and of each strategy of ours (the loaded model, MTP adapter included). Each repeat runs every prompt with every method, the order of
   methods rotating from one repeat to the next; each generation is timed on its own, wall-clock,
   device synchronised, Python overhead included. A method's speed in one repeat is its generated
   tokens over its seconds summed over the prompts; the table shows the median over repeats and
   its ratio to HF ``generate`` (the paper reports wall-clock speed-ups the same way, section 4.5).
   One untimed warm-up generation per method comes first.
2. **Width curve**: milliseconds per forward pass over a cached prompt, by tokens fed (1, 2, 4, 8, 16):
   transformers' forward of the plain base (T real tokens), ours on the base weights (T real
   tokens: a prefill / verify-like pass), ours with the adapter (1 real token + T-1 mask tokens:
   an MTP pass) and llama.cpp's call over T tokens (all logits), each with its ratio to our 1-token
   base pass.
3. **Row exactness**: for each width, how many rows of a pass are bit-identical to one-token passes of the
   same tokens after the same cache (:mod:`model.engine.exactness`; what lossless verification rests on).
   On our kernels the width curve also times the torch fast path (``MTP_KERNELS=off``) beside them.
4. **Bandwidth**: the weight bytes a 1-token pass reads (every parameter once; an untied input
   embedding is not read whole) over the time of that pass, beside the device's measured read
   bandwidth (CPU: the sum of a 1 GiB tensor; CUDA: a 1 GiB device copy, read + write).

The report states the dtype, the forward path (:attr:`~model.engine.loaded_model.LoadedModel.forward_path`),
torch threads and the load average before and after (other jobs on the machine slow every method;
the ratios, measured side by side, are what to read). Default prompts: the first problems of
``assets/gsm8k_test_sample.jsonl`` (GSM8K test split, MIT licence; see assets/README.md).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..engine.decoding import hf_generate, run, sync
from ..engine.width import DEFAULT_WIDTHS, WIDTH_PROMPT
from ..engine.loaded_model import LoadedModel
from ..engine.loading import REPO_ROOT
from ..engine.sampling import GREEDY, Sampling, for_request
from ..engine.strategies import check_max_new_tokens, parse_strategies
from .accuracy import draft_metrics

HF = "hf_generate"
DEFAULT_DATA = REPO_ROOT / "assets" / "gsm8k_test_sample.jsonl"
DEFAULT_STRATEGIES = "standard,confadapt:0.9:4,verify:4,confadapt:0.9:16"


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


def plain_base(lm: LoadedModel) -> LoadedModel:
    """The base model as a user would run it: without peft's wrapper and LoRA layers (a copy of the
    weights, the adapter removed), same dtype and device. A model without a peft adapter is returned
    as is."""
    from peft import PeftModel

    if not isinstance(lm.model, PeftModel):
        return lm
    base = copy.deepcopy(lm.model).unload()
    base.eval()
    return dataclasses.replace(lm, model=base, adapter=None)


LLAMA = "llama_cpp"


def llama_cpp_baseline(lm: LoadedModel, threads: int) -> tuple[Any, str | None]:
    """``(LlamaCpp, None)`` for the embedded default or a GGUF source when llama-cpp-python is installed;
    ``(None, why not)`` otherwise (:mod:`model.evaluation.llama_cpp`)."""
    from . import llama_cpp as lc

    why = lc.available()
    if why is not None:
        return None, why
    from ..engine.loading import DEFAULT_SOURCE, smollm2_gguf_path

    if lm.source == DEFAULT_SOURCE:
        source = smollm2_gguf_path()
    elif str(lm.source).endswith(".gguf"):
        source = Path(lm.source)
    else:
        return None, ("llama.cpp baseline skipped: it needs a GGUF of the same weights (the embedded default or a "
                      ".gguf source)")
    try:
        return lc.LlamaCpp(lc.bf16_gguf(source), threads=threads), None
    except Exception as e:  # noqa: BLE001 - a broken build must not stop the bench
        return None, f"llama.cpp baseline skipped: {type(e).__name__}: {e}"


def run_one(lm: LoadedModel, method: str, strategy: Any, prompt_ids: list[int], max_new_tokens: int,
            llama: Any = None, sampling: Sampling | None = None) -> dict:
    """One timed generation. Returns ``{"tokens", "forward_passes", "seconds", "token_ids"}``.

    ``seconds`` is wall-clock for the whole generation (device synchronised before and after).
    For HF ``generate`` the number of forward passes equals the number of new tokens.
    """
    dev = lm.device
    sync(dev)
    t0 = time.perf_counter()
    drafts: list[list[int]] = []
    if method == HF:
        ids = hf_generate(lm, prompt_ids, max_new_tokens, sampling)
        passes = len(ids)
    elif method == LLAMA:
        ids = llama.generate(prompt_ids, max_new_tokens, lm.stop_token_ids)
        passes = len(ids)
    else:
        res = run(lm, prompt_ids, strategy, max_new_tokens, sampling)
        ids, passes = res.token_ids, res.forward_passes
        drafts = [list(p.counted_drafts) for p in res.passes if p.fed_drafts]
    sync(dev)
    return {"tokens": len(ids), "forward_passes": passes, "seconds": time.perf_counter() - t0, "token_ids": ids,
            "drafts": drafts}


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

        methods.append(("torch_path", "torch path (off), "
                        + ("1 real + T-1 masks" if lm.adapter is not None else "T real tokens"), old_pass))
    worker = _WorkerThread()  # the page's passes run on a thread of their own: timed beside the main thread's
    thread_cache = lm.new_cache()
    worker.call(lambda: lm.forward(torch.tensor([ids], device=dev), thread_cache, num_masks=0, logits_to_keep=1))
    thread_label = ("ours + adapter, called from a worker thread" if lm.adapter is not None
                    else "ours, called from a worker thread")
    methods.append(("ours_worker_thread", thread_label,
                    lambda t: worker.call(lambda: ours(thread_cache, t, lm.adapter is not None))))
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
    worker.close()
    ref = ms["ours_base"][0] if widths and widths[0] == 1 else None
    rows = [{"name": name, "label": label, "ms": ms[name],
             "ratio": [v / ref for v in ms[name]] if ref else None} for name, label, _ in methods]
    return {"context_tokens": len(ids), "widths": list(widths), "rows": rows}


def bench(
    lm: LoadedModel,
    prompts: Sequence[str],
    strategy_specs: str | Sequence[Any] = DEFAULT_STRATEGIES,
    *,
    repeats: int = 3,
    max_new_tokens: int = 64,
    warmup: bool = True,
    widths: Sequence[int] = DEFAULT_WIDTHS,
    width_repeats: int = 15,
    measure_bandwidth: bool = True,
    plain: LoadedModel | None = None,
    llama_cpp: bool = True,
    sampling: Sampling | None = None,
) -> dict:
    """Time HF ``generate`` on the plain base and each strategy, then the width curve and bandwidth.

    Args:
        lm: the model our strategies run (adapter included).
        prompts: user messages (formatted with the model's prompt format).
        strategy_specs: our strategies (``standard``, ``static:K``, ``confadapt:TAU[:K_MAX]``,
            ``verify[:K_MAX]``; k_max defaults to the adapter's).
        repeats: timed rounds; the median over them is reported.
        max_new_tokens: per generation.
        warmup: one untimed generation per method first.
        widths: tokens per pass of the width curve (empty: no curve).
        width_repeats: timed passes per width and method (median).
        measure_bandwidth: measure the device's memory bandwidth (1 GiB).
        plain: the plain base for HF ``generate`` (default :func:`plain_base` of ``lm``).
        llama_cpp: add llama.cpp greedy decoding of the same weights as a second baseline, and its width
            curve, when llama-cpp-python is installed (:func:`llama_cpp_baseline`; greedy only: left out when
            sampling).
        sampling: greedy when None; else every method samples prompt ``i`` with these settings and the seed
            advanced by ``i`` (HF ``generate`` with its own sampling); the output-equality checks are then
            not made (different draws), the drafts' acceptance by position is reported.

    Returns:
        ``{"config", "methods": [{"method", "label", "tokens_per_second" (median), "runs",
        "ratio_to_hf", "effective_k", "forward_passes_per_second", "tokens", "forward_passes"}],
        "standard_matches_hf", "verify_matches_standard", "width", "bandwidth", "row_exactness", "kernels"}``.

    Raises:
        ValueError: no prompts, repeats < 1, bad max_new_tokens, strategy or width.
    """
    check_max_new_tokens(max_new_tokens)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer ≥ 1, got {repeats!r}.")
    if not prompts:
        raise ValueError("No prompts to benchmark.")
    if any(isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 64 for w in widths):
        raise ValueError(f"widths must be integers from 1 to 64, got {list(widths)!r}.")
    load_before = _loadavg()
    strategies = parse_strategies(strategy_specs, lm.default_k_max)
    plain = plain if plain is not None else plain_base(lm)
    runners = {HF: plain}
    methods: list[tuple[str, Any]] = [(HF, None)] + [(s.spec, s) for s in strategies]
    sampling = sampling or GREEDY
    if not sampling.greedy:
        llama, llama_note = None, "llama.cpp baseline left out: it decodes greedily, these runs sample"
    else:
        llama, llama_note = llama_cpp_baseline(lm, torch.get_num_threads()) if llama_cpp else (None, None)
    if llama is not None:
        methods.insert(1, (LLAMA, None))
    prompt_ids = [lm.prompt_ids(p) for p in prompts]
    if warmup:
        for name, s in methods:
            run_one(runners.get(name, lm), name, s, prompt_ids[0], min(max_new_tokens, 8), llama, sampling)
    per: dict[str, list[dict]] = {name: [] for name, _ in methods}
    outputs: dict[str, list[list[int]]] = {name: [] for name, _ in methods}
    drafts: dict[str, list[list[int]]] = {name: [] for name, _ in methods}
    for r in range(repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        totals = {name: {"tokens": 0, "forward_passes": 0, "seconds": 0.0} for name, _ in methods}
        for i, ids in enumerate(prompt_ids):
            for name, s in order:
                res = run_one(runners.get(name, lm), name, s, ids, max_new_tokens, llama, for_request(sampling, i))
                for key in ("tokens", "forward_passes", "seconds"):
                    totals[name][key] += res[key]
                if r == 0:
                    outputs[name].append(res["token_ids"])
                    drafts[name] += res["drafts"]
        for name, _ in methods:
            per[name].append(totals[name])

    rows = []
    for name, s in methods:
        runs = per[name]
        tps = [t["tokens"] / t["seconds"] if t["seconds"] > 0 else 0.0 for t in runs]
        pps = [t["forward_passes"] / t["seconds"] if t["seconds"] > 0 else 0.0 for t in runs]
        rows.append({
            "method": name, "label": s.label if s is not None else (
                "HF generate, plain base" if name == HF else "llama.cpp greedy, BF16 GGUF"),
            "tokens_per_second": statistics.median(tps), "runs": tps,
            "forward_passes_per_second": statistics.median(pps),
            "tokens": runs[0]["tokens"], "forward_passes": runs[0]["forward_passes"],
            "effective_k": runs[0]["tokens"] / runs[0]["forward_passes"] if runs[0]["forward_passes"] else 0.0,
            **draft_metrics(drafts[name]),
        })
    hf_tps = rows[0]["tokens_per_second"]
    for row in rows:
        row["ratio_to_hf"] = row["tokens_per_second"] / hf_tps if hf_tps > 0 else None
    std = outputs.get("standard") if sampling.greedy else None  # sampled outputs are different draws
    verify_specs = [s.spec for s in strategies if s.lossless]

    width = width_curve(lm, plain, widths, width_repeats, before=torch_path_view(lm)) if widths else None
    exactness = row_exactness_report(lm, [w for w in widths if w >= 2] or (2, 4, 8, 16))
    if width is not None and llama is not None:
        from .llama_cpp import LlamaCpp

        wide = LlamaCpp(llama.gguf, threads=torch.get_num_threads(), all_logits=True)
        ms = wide.pass_ms(lm.prompt_ids(WIDTH_PROMPT), width["widths"], width_repeats)
        wide.close()
        ref = next((r["ms"][0] for r in width["rows"] if r["name"] == "ours_base"), None)
        width["rows"].append({"name": LLAMA, "label": "llama.cpp, BF16 GGUF (T real tokens)", "ms": ms,
                              "ratio": [v / ref for v in ms] if ref and width["widths"][0] == 1 else None})
    if llama is not None:
        llama.close()
    bandwidth = None
    nbytes = pass_bytes(plain.model)
    if measure_bandwidth:
        bw, how = read_bandwidth(lm.device)
        bandwidth = {"measured_bytes_per_second": bw, "measured_by": how, "pass_bytes": nbytes}
        if width is not None and width["widths"][0] == 1:
            for row in width["rows"]:
                if row["name"] in ("hf_plain", "ours_base"):
                    achieved = nbytes / (row["ms"][0] / 1e3)
                    bandwidth[row["name"]] = {"ms_per_pass": row["ms"][0], "bytes_per_second": achieved,
                                              "fraction": achieved / bw}
    return {
        "config": {"model": lm.source, "device": str(lm.device), "dtype": lm.dtype_name,
                   "forward_path": lm.forward_path, "hf_baseline": "HF generate on the plain base (no peft), "
                   f"{plain.dtype_name}", "prompts": len(prompts), "repeats": repeats,
                   "max_new_tokens": max_new_tokens, "torch_threads": torch.get_num_threads(),
                   "weight_bytes": weight_bytes(plain.model), "pass_bytes": nbytes, "mtp_trained": lm.mtp_trained,
                   "adapter": lm.adapter, "cpu": _cpu_name(), "load_average_before": load_before,
                   "sampling": sampling.to_dict(),
                   "load_average_after": _loadavg()},
        "methods": rows,
        "standard_matches_hf": (std == outputs[HF]) if std is not None else None,
        "llama_cpp": {"gguf": str(llama.gguf), "tokens_equal_to_standard": _share_equal(outputs[LLAMA], std)}
        if llama is not None else {"note": llama_note},
        "verify_matches_standard": {v: outputs[v] == std for v in verify_specs} if std is not None else {},
        "width": width,
        "bandwidth": bandwidth,
        "row_exactness": exactness,
        "kernels": _kernel_line(),
    }


def _kernel_line() -> str:
    """Which of our kernel paths this process runs, and why (``model.engine.kernels.status``)."""
    from ..engine.kernels import KernelError, status

    try:
        return status().reason
    except KernelError as e:
        return str(e)


def _share_equal(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]] | None) -> float | None:
    """Share of positions where two lists of generations hold the same token (None without ``b``)."""
    if b is None:
        return None
    same = total = 0
    for x, y in zip(a, b):
        same += sum(p == q for p, q in zip(x, y))
        total += max(len(x), len(y))
    return same / total if total else None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="ignore").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def format_table(report: dict) -> str:
    """The report as plain-text tables (tokens/s per method; width curve; bandwidth)."""
    c = report["config"]
    head = f"{'method':<34} {'tokens/s':>9} {'x HF':>6} {'eff. k':>7} {'passes/s':>9} {'new tokens':>10}"
    lines = [head, "-" * len(head)]
    for r in report["methods"]:
        drafts = "" if r.get("draft_acceptance_rate") is None else (
            f"  drafts accepted {r['draft_acceptance_rate']:.2f} (by position "
            + " / ".join(f"{x:.2f}" for x in r["acceptance_by_position"]) + ")")
        lines.append(f"{r['label']:<34} {r['tokens_per_second']:>9.1f} {r['ratio_to_hf']:>6.2f} "
                     f"{r['effective_k']:>7.2f} {r['forward_passes_per_second']:>9.1f} {r['tokens']:>10d}{drafts}")
    lines.append(f"median of {c['repeats']} repeats x {c['prompts']} prompts x {c['max_new_tokens']} new tokens; "
                 f"{c['device']} {c['dtype']}, {c['torch_threads']} torch threads; {c['forward_path']}; "
                 f"{Sampling(**c.get('sampling', {})).label}")
    lines.append(f"baseline: {c['hf_baseline']}; weights {c['weight_bytes'] / 1e6:.0f} MB")
    if report["standard_matches_hf"] is not None:
        lines.append(f"standard output == HF generate output: {report['standard_matches_hf']}")
    lc = report.get("llama_cpp") or {}
    if lc.get("note"):
        lines.append(lc["note"])
    elif lc.get("tokens_equal_to_standard") is not None:
        lines.append(f"llama.cpp ({Path(lc['gguf']).name}) greedy tokens equal to our standard decoding's: "
                     f"{lc['tokens_equal_to_standard']:.1%} of positions")
    for spec, same in report.get("verify_matches_standard", {}).items():
        lines.append(f"{spec} output == standard output (lossless): {same}")
    lines.append("new tokens: generated in one repeat over all prompts; a method that hits a stop token early "
                 "spends a larger share of its time on the prefill")
    w = report.get("width")
    if w:
        lines.append("")
        lines.append(f"ms per forward pass by tokens fed (cache of {w['context_tokens']} tokens; "
                     "x = ratio to our 1-token base pass)")
        lw = max([40] + [len(row["label"]) + 1 for row in w["rows"]])  # the longest label, then the columns
        cells = [[f"{ms:.1f} ({x:.2f}x)" if row["ratio"] else f"{ms:.1f}"
                  for ms, x in zip(row["ms"], row["ratio"] or [0] * len(row["ms"]))] for row in w["rows"]]
        cw = max([14] + [len(c) + 1 for row in cells for c in row])  # the widest cell (12.34x, 1234.5 ms)
        wh = f"{'':<{lw}}" + "".join(f"{t:>{cw}}" for t in w["widths"])
        lines += [wh, "-" * len(wh)]
        for row, row_cells in zip(w["rows"], cells):
            lines.append(f"{row['label']:<{lw}}" + "".join(f"{c:>{cw}}" for c in row_cells))
    b = report.get("bandwidth")
    if b:
        lines.append("")
        lines.append(f"memory bandwidth measured: {b['measured_bytes_per_second'] / 1e9:.1f} GB/s ({b['measured_by']})")
        for name, label in (("ours_base", "ours"), ("hf_plain", "transformers")):
            if name in b:
                x = b[name]
                lines.append(f"bandwidth achieved, {label}: {b['pass_bytes'] / 1e6:.0f} MB of weights in "
                             f"{x['ms_per_pass']:.1f} ms = {x['bytes_per_second'] / 1e9:.1f} GB/s "
                             f"({x['fraction']:.0%} of measured)")
    ex = report.get("row_exactness")
    if ex:
        lines.append("")
        lines.append("rows of a T-token pass bit-identical to one-token passes of the same tokens after the same cache: "
                     + ", ".join(f"T={e['width']}: MTP {e['mtp_equal']}/{e['width']}, real {e['real_equal']}/{e['width']}"
                                 for e in ex))
    if report.get("kernels"):
        lines.append(f"kernels: {report['kernels']}")
    lb, la = c.get("load_average_before"), c.get("load_average_after")
    if lb:
        lines.append(f"load average (1/5/15 min) before {lb}, after {la}; cpu: {c.get('cpu')}")
    return "\n".join(lines)
