"""The embedded default's GGUF, read once: a dequantised float32 copy kept on disk (``~/.cache/mtp-lm``), and
each GGUF file parsed once per load (the gguf library memoised meanwhile).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _gguf_cache_lock(cache: Path | None) -> Any:
    """A file lock beside the GGUF cache directory (``filelock``, waits up to 10 minutes); a no-op context when
    there is no cache, it exists already, or its folder is not writable (each process then parses the file)."""
    import contextlib

    from filelock import FileLock

    if cache is None or _holds_copy(cache):
        return contextlib.nullcontext()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return contextlib.nullcontext()
    if not os.access(cache.parent, os.W_OK):
        return contextlib.nullcontext()
    return FileLock(str(cache.with_name(cache.name + ".lock")), timeout=600)


def _gguf_cache_dir(gguf: Path) -> Path | None:
    """Where the dequantised copy of a GGUF file is kept (``$MTP_CACHE_DIR``, default
    ``~/.cache/mtp-lm``), keyed by file name, size and a hash of its first and last MiB (not its
    mtime: a reinstalled package must hit the same cache); None when ``MTP_NO_CACHE=1``. The copy is float32
    (SmolLM2-135M: 538 MB on disk; a load in bf16 rounds it as it reads), hence the ``-float32`` suffix: copies
    that older versions wrote in the first load's dtype are not read."""
    import hashlib

    if os.environ.get("MTP_NO_CACHE") == "1" or not gguf.is_file():
        return None
    root = Path(os.environ.get("MTP_CACHE_DIR", Path.home() / ".cache" / "mtp-lm"))
    size = gguf.stat().st_size
    h = hashlib.sha256()
    with gguf.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return root / f"{gguf.stem}-{size}-{h.hexdigest()[:12]}-float32"


def _holds_copy(cache: Path | None) -> bool:
    """Whether a GGUF cache directory holds a complete dequantised copy (it is renamed into place whole,
    config.json included, by :func:`_write_gguf_cache`)."""
    return cache is not None and (cache / "config.json").is_file()


def _write_gguf_cache(model: Any, tokenizer: Any, cache: Path) -> bool:
    """Save a GGUF-loaded model as a plain safetensors model directory (written atomically).

    Returns True when ``cache`` holds the copy (written here or by a concurrent process), False when
    it could not be written (the caller keeps the GGUF-loaded model)."""
    import copy
    import shutil
    import tempfile

    from safetensors.torch import save_model

    tmp: Path | None = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".partial-"))
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantised already
        config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(cache)
        return True
    except OSError as e:  # read-only or full disk, or another process won the race: go on without
        log.info("Not caching the dequantised GGUF in %s: %s", cache, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return _holds_copy(cache)


#: Serialises the loads that parse a GGUF file in this process (the gguf library is patched meanwhile).
_GGUF_PARSE_LOCK = threading.RLock()


@contextlib.contextmanager
def _gguf_parsed_once() -> Any:
    """While a GGUF file loads, each file is parsed once and gguf-py's tensor-name table built once per
    architecture: ``gguf.GGUFReader`` and ``gguf.get_tensor_name_map`` are memoised for the duration
    (transformers parses the file for the config, the tokenizer and the weights, and builds the table per
    module; the memory check parses it for its size): a first load of the embedded default took 26 s
    instead of 58 s (2-core AMD EPYC, one thread). A reader is only read from once built (a read-only
    memory map), so sharing it gives the same values. The library is restored on exit; nested and
    concurrent loads wait here."""
    try:
        import gguf
    except ImportError:  # the loader says what is missing
        yield
        return
    with _GGUF_PARSE_LOCK:
        if getattr(gguf, "_mtp_parsed_once", False):  # a nested load: already memoised
            yield
            return
        reader_of, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}

        def reader(path: Any, mode: str = "r") -> Any:
            key = (os.path.realpath(str(path)), mode)
            if key not in readers:
                readers[key] = reader_of(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
        gguf._mtp_parsed_once = True
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_of, name_map
            del gguf._mtp_parsed_once
