"""Our CPU kernels for the forward pass: build, load and choose them (``mtp_kernels.cpp`` beside this file).

Why our own: an MTP pass is worth taking only if (1) a pass of several rows costs about a pass of one and
(2) each row of a wide pass computes exactly what a one-token pass computes (lossless verification compares
the two). The library kernels give neither on every CPU: SDPA with several queries rounds differently from one
query, MKL's float32 ``mm`` rounds M >= 2 rows differently from M = 1, and on AVX2 CPUs a pass of 4 rows costs
twice a pass of one. ``mtp_kernels.cpp`` runs the whole pass in one call: every output element summed in one
fixed order by one thread, the weights read once per pass for all rows (docs/DESIGN.md, "Kernels").

How it is built: a plain shared library compiled by ``g++`` (about 5 s) and called through ``ctypes`` on
``data_ptr()``; not ``torch.utils.cpp_extension``, which took 25 s cold (56 s under load) for the same code,
needs the torch headers and gives the same bits. ``scripts/setup.sh`` builds it; a first use without a build
compiles it once into ``~/.cache/mtp-lm/kernels`` (``$MTP_KERNELS_DIR``) and says so on stderr. A machine without
a compiler keeps the library path (:func:`status` says why).

Which kernel runs: ``MTP_KERNELS=auto|amx|avx512bf16|avx2|off`` (default ``auto``: the best the CPU has).
``avx512bf16`` needs AVX512F/BW/VL and AVX512-BF16 (``vdpbf16ps``); ``avx2`` needs AVX2 and FMA. ``amx`` is
refused: no AMX tile kernel is built in this version (a CPU with AMX also has AVX512-BF16, which ``auto``
picks there). A forced path the CPU cannot run is refused with one line naming the missing instructions.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...errors import KernelError

__all__ = ["KernelError", "KernelStatus", "build", "choose_isa", "cpu_flags", "missing", "requested", "status"]

ENV = "MTP_KERNELS"
CHOICES = ("auto", "amx", "avx512bf16", "avx2", "off")
SOURCE = Path(__file__).with_name("mtp_kernels.cpp")
ABI_VERSION = 4
ISA_CODES = {"avx2": 1, "avx512bf16": 2}
#: CPU flags (``/proc/cpuinfo``) each path needs.
NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "amx": ("amx_tile", "amx_bf16"),
}
CFLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="ignore")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def missing(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    """The instructions ``isa`` needs that the CPU lacks (empty: it can run)."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in NEEDS[isa] if f not in flags]


def requested() -> str:
    """``MTP_KERNELS`` as given (``auto`` when unset).

    Raises:
        KernelError: a value outside :data:`CHOICES`.
    """
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise KernelError(f"{ENV}={value!r}: choose one of {', '.join(CHOICES)}")
    return value


def choose_isa(value: str | None = None, flags: frozenset[str] | None = None) -> str | None:
    """The kernel path for ``value`` (default: :func:`requested`) on a CPU with ``flags``: ``"avx512bf16"``,
    ``"avx2"``, or None (``off``, or ``auto`` on a CPU with neither).

    Raises:
        KernelError: a forced path this CPU cannot run, or ``amx`` (not built in this version).
    """
    value = requested() if value is None else value
    if value == "off":
        return None
    if value == "amx":
        lack = missing("amx", flags)
        why = f"this CPU lacks {', '.join(lack)}; " if lack else ""
        raise KernelError(f"{ENV}=amx: {why}no AMX tile kernel is built in this version "
                          f"(use avx512bf16, which every AMX CPU has, or auto)")
    if value == "auto":
        for isa in ("avx512bf16", "avx2"):
            if not missing(isa, flags):
                return isa
        return None
    lack = missing(value, flags)
    if lack:
        raise KernelError(f"{ENV}={value}: this CPU lacks {', '.join(lack)}")
    return value


# ------------------------------------------------------------------------------------------- building
def cache_dir() -> Path:
    """Where built kernels live: ``$MTP_KERNELS_DIR``, default ``~/.cache/mtp-lm/kernels`` (not under
    ``$MTP_CACHE_DIR``, which tests point at empty folders for model copies: the kernels stay built)."""
    return Path(os.environ.get("MTP_KERNELS_DIR") or Path.home() / ".cache" / "mtp-lm" / "kernels")


def library_path() -> Path:
    """The built library for this source and these flags (its name carries their hash)."""
    h = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"libmtp_kernels-{h}.so"


def compiler() -> str | None:
    """The C++ compiler to build with (``$CXX``, else ``g++``), or None when there is none."""
    cxx = os.environ.get("CXX", "g++")
    return shutil.which(cxx)


def build(quiet: bool = False) -> Path:
    """Compile ``mtp_kernels.cpp`` into :func:`library_path` unless it is there; returns the path.

    Writes to a temporary file and renames it, so concurrent builds (test workers) never load half a file.

    Raises:
        KernelError: no compiler, or the compiler failed (its first lines of errors in the message).
    """
    out = library_path()
    if out.exists():
        return out
    cxx = compiler()
    if cxx is None:
        name = os.environ.get("CXX") or "g++"
        raise KernelError(f"no C++ compiler ({name}: not found): install g++ (or set CXX) to build our kernels")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"mtp kernels: compiling {SOURCE.name} once into {out.parent} (~5 s)", file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            err = " | ".join(proc.stderr.strip().splitlines()[:3])
            raise KernelError(f"compiling our kernels failed: {err}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# ------------------------------------------------------------------------------------------- ctypes
class Linear(ctypes.Structure):
    """``mtp_linear`` (see mtp_kernels.cpp)."""

    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("layout", ctypes.c_int32),
                ("bias", ctypes.c_void_p), ("rank", ctypes.c_int32), ("lora_a", ctypes.c_void_p),
                ("members", ctypes.c_int32), ("m_out0", ctypes.c_int32 * 4), ("m_out1", ctypes.c_int32 * 4),
                ("m_r0", ctypes.c_int32 * 4), ("m_r1", ctypes.c_int32 * 4), ("m_b", ctypes.c_void_p * 4),
                ("lora_layout", ctypes.c_int32)]


class Layer(ctypes.Structure):
    """``mtp_layer``."""

    _fields_ = [("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear), ("ln1", ctypes.c_void_p),
                ("ln2", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p)]


class Model(ctypes.Structure):
    """``mtp_model``."""

    _fields_ = [("hidden", ctypes.c_int32), ("heads", ctypes.c_int32), ("kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("inter", ctypes.c_int32), ("layers", ctypes.c_int32),
                ("dtype", ctypes.c_int32), ("isa", ctypes.c_int32), ("eps", ctypes.c_float),
                ("scaling", ctypes.c_float), ("layer", ctypes.POINTER(Layer)), ("norm", ctypes.c_void_p),
                ("head", Linear), ("head_override", Linear), ("override_idx", ctypes.c_void_p)]


class Batch(ctypes.Structure):
    """``mtp_batch``: the sequences of one pass (rows, KV caches, positions, visibility, adapter rows)."""

    _fields_ = [("nseq", ctypes.c_int32), ("row0", ctypes.c_void_p), ("kcache", ctypes.c_void_p),
                ("vcache", ctypes.c_void_p), ("cap", ctypes.c_void_p), ("pos", ctypes.c_void_p),
                ("visible", ctypes.c_void_p), ("adapter", ctypes.c_void_p), ("keep", ctypes.c_void_p),
                ("nkeep", ctypes.c_int32)]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.mtp_abi_version.restype = i32
    lib.mtp_alloc.argtypes, lib.mtp_alloc.restype = [i64], vp
    lib.mtp_free.argtypes, lib.mtp_free.restype = [vp], None
    lib.mtp_packed_bytes.argtypes, lib.mtp_packed_bytes.restype = [i32, i32, i32], i64
    lib.mtp_pack_weight.argtypes, lib.mtp_pack_weight.restype = [vp, i32, i32, i32, i32, vp], None
    lib.mtp_forward_batch.argtypes = [ctypes.POINTER(Model), vp, i32, ctypes.POINTER(Batch), vp, vp, vp, i32]
    lib.mtp_forward_batch.restype = ctypes.c_int
    return lib


@dataclass(frozen=True)
class KernelStatus:
    """Which kernel path this process runs and why.

    Attributes:
        isa: ``"avx512bf16"``, ``"avx2"`` or None (the library path runs).
        reason: one line: the path and what chose it, or why ours cannot run.
        library: the loaded ``ctypes.CDLL`` (None when ``isa`` is None).
    """

    isa: str | None
    reason: str
    library: ctypes.CDLL | None = None


_STATUS: dict[tuple[str, str], KernelStatus] = {}


def status() -> KernelStatus:
    """The kernel path for the current ``MTP_KERNELS`` (built and loaded on first call; cached per value).

    Raises:
        KernelError: a forced path this CPU cannot run, an unknown value, or a forced path whose build failed.
    """
    value = requested()
    key = (value, os.environ.get("MTP_KERNELS_DIR", ""))
    if key in _STATUS:
        return _STATUS[key]
    isa = choose_isa(value)
    if isa is None:
        why = (f"{ENV}=off" if value == "off" else
               "this CPU has neither AVX2+FMA nor AVX512-BF16 (" + ", ".join(missing("avx2")) + " missing)")
        st = KernelStatus(None, why)
    else:
        try:
            lib = _bind(ctypes.CDLL(str(build())))
            if lib.mtp_abi_version() != ABI_VERSION:
                raise KernelError("the built kernel library is of another version")
            st = KernelStatus(isa, f"our kernels, {isa} ({'forced' if value != 'auto' else 'auto'})", lib)
        except (KernelError, OSError) as e:
            if value != "auto":
                raise KernelError(f"{ENV}={value}: {e}") from e
            st = KernelStatus(None, f"our kernels unavailable: {e}")
            print(f"mtp kernels: {st.reason}; the torch path runs", file=sys.stderr, flush=True)
    _STATUS[key] = st
    return st
