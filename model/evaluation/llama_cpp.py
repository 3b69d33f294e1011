"""llama.cpp as a second baseline of the benchmark: the fastest plain greedy decoder of the same weights.

MTP's claim is "the same model, faster": on a CPU the fastest plain decoding a practitioner could run is
llama.cpp, not HF ``generate``. When ``llama-cpp-python`` is installed (an optional extra, not in
requirements.txt: it compiles llama.cpp from source, 10-30 minutes on 2 cores)::

    .venv/bin/pip install --no-deps llama-cpp-python==0.3.36 diskcache

``model.bench`` runs llama.cpp greedy decoding beside our strategies, one thread each, on a BF16 GGUF of
the same weights: for the embedded default, written once from the packaged Q4_1 file by llama.cpp's own
``llama_model_quantize`` (``allow_requantize``) into the cache directory. Its width curve (ms per call by
tokens fed, all logits requested, as an MTP pass needs them) goes beside ours. Without the package the
bench says so in one line.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from pathlib import Path
from typing import Mapping, Sequence

INSTALL_HINT = ("llama.cpp baseline skipped: llama-cpp-python is not installed (optional; `pip install --no-deps "
                "llama-cpp-python==0.3.36 diskcache` compiles llama.cpp, 10-30 minutes on 2 cores)")


def available() -> str | None:
    """None when llama-cpp-python imports, else the one line that says why the baseline is skipped."""
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or built for another CPU
        return INSTALL_HINT
    return None


def openmp_caveat(threads: int, environ: Mapping[str, str] | None = None) -> str | None:
    """The line the report adds when llama.cpp's baseline is handicapped by this process's OpenMP settings, else
    None. llama.cpp (built with OpenMP, its default) waits between its operations through OpenMP: with
    ``OMP_WAIT_POLICY=PASSIVE`` (what ``app.py`` and the tests set for torch's sake) its threads sleep between
    them, which on a 2-core VM halved its greedy decoding at two threads (27 against 60 tokens/s). One thread has no
    OpenMP team, so nothing to say there. ``environ``: default ``os.environ``."""
    env = os.environ if environ is None else environ
    if threads <= 1 or env.get("OMP_WAIT_POLICY", "").strip().lower() != "passive":
        return None
    return (f"caution: OMP_WAIT_POLICY=PASSIVE is set, so llama.cpp's OpenMP threads sleep between its operations; "
            f"at {threads} threads it decodes slower than it can (run the bench without it for llama.cpp's best)")


def bf16_gguf(source_gguf: Path, cache_dir: Path | None = None) -> Path:
    """A BF16 GGUF of ``source_gguf`` (any llama.cpp type), written once by ``llama_model_quantize`` with
    ``allow_requantize`` into ``cache_dir`` (default ``$MTP_CACHE_DIR`` or ``~/.cache/mtp-lm``).

    Raises:
        RuntimeError: llama.cpp could not write it.
    """
    import llama_cpp

    root = cache_dir or Path(os.environ.get("MTP_CACHE_DIR", Path.home() / ".cache" / "mtp-lm"))
    dst = root / f"{source_gguf.stem}-BF16.gguf"
    if dst.is_file():
        return dst
    root.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
    params.allow_requantize = True
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(source_gguf).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0 or not tmp.is_file():
        raise RuntimeError(f"llama_model_quantize could not write a BF16 copy of {source_gguf} (code {rc}).")
    tmp.replace(dst)
    return dst


class LlamaCpp:
    """llama.cpp greedy decoding of a GGUF, ``threads`` threads.

    Args:
        gguf: the model file.
        threads: CPU threads for generation and prompt processing.
        all_logits: compute the logits of every token of a call (what a width curve of MTP-like passes
            needs); greedy decoding only needs the last one.
    """

    def __init__(self, gguf: Path, threads: int = 1, all_logits: bool = False, n_ctx: int = 2048):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, logits_all=all_logits, verbose=False)
        self.gguf, self.threads = gguf, threads

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy new ids (argmax of each step's logits), up to and including the first stop id."""
        import numpy as np

        llm = self.llm
        llm.reset()
        llm.eval(list(prompt_ids))
        out: list[int] = []
        stops = set(stop_ids)
        vocab = llm.n_vocab()
        while len(out) < max_new_tokens:
            # the last token's logits, straight from the context (llama-cpp-python 0.3 keeps no scores
            # without logits_all)
            tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
            out.append(tok)
            if tok in stops or len(out) == max_new_tokens:
                break
            llm.eval([tok])
        return out

    def pass_ms(self, context_ids: Sequence[int], widths: Sequence[int], repeats: int = 15) -> list[float]:
        """Median milliseconds of one call feeding ``w`` tokens after a cached ``context_ids``, per width
        (the cache is rolled back after each call)."""
        llm = self.llm
        llm.reset()
        llm.eval(list(context_ids))
        cached = llm.n_tokens
        out = []
        for w in widths:
            toks = (list(context_ids) * (1 + w // max(1, len(context_ids))))[:w]
            times = []
            for r in range(repeats + 1):
                llm.n_tokens = cached  # eval drops the cache past n_tokens first
                t0 = time.perf_counter()
                llm.eval(toks)
                if r:
                    times.append(time.perf_counter() - t0)
            out.append(1e3 * statistics.median(times))
        llm.n_tokens = cached
        return out

    def close(self) -> None:
        """Free llama.cpp's model and context now (at interpreter exit its finaliser may fail noisily)."""
        self.llm.close()
