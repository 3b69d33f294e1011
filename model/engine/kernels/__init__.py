"""Our CPU kernels for the forward pass: build, load and choose them (``mtp_kernels.cpp`` beside this file, with
its parts ``mtp_*.h``: one translation unit).

Why our own: an MTP pass is worth taking only if (1) a pass of several rows costs about a pass of one and
(2) each row of a wide pass computes exactly what a one-token pass computes (lossless verification compares
the two). The library kernels give neither on every CPU: SDPA with several queries rounds differently from one
query, MKL's float32 ``mm`` rounds M >= 2 rows differently from M = 1, and on AVX2 CPUs a pass of 4 rows costs
twice a pass of one. ``mtp_kernels.cpp`` runs the whole pass in one call: every output element summed in one
fixed order by one thread, the weights read once per pass for all rows (docs/DESIGN.md, "Kernels").

How it is built: a plain shared library compiled by ``g++`` (about 8 s on 2 cores) and called through ``ctypes`` on
``data_ptr()``; not ``torch.utils.cpp_extension``, which took 25 s cold (56 s under load) for the same code,
needs the torch headers and gives the same bits. ``scripts/setup.sh`` builds it; a first use without a build
compiles it once into ``~/.cache/mtp-lm/kernels`` (``$MTP_KERNELS_DIR``) and says so on stderr. A machine without
a compiler keeps the library path (:func:`status` says why).

Which kernel runs: ``MTP_KERNELS=auto|amx|avx512bf16|avx2|off`` (default ``auto``: the best the CPU has, in
that order). ``avx2`` needs AVX2 and FMA; ``avx512bf16`` AVX512F/BW/VL/DQ and AVX512-BF16 (``vdpbf16ps``); ``amx``
those and AMX-TILE / AMX-BF16 (the bf16 projections on tiles), and Linux's permission for the tile state. A forced
path the CPU cannot run is refused with one line naming the missing instructions. Every path is checked once when
it is loaded (``mtp_selftest``: each row of a wide product has the bits of its one-row product, 2 threads the bits
of 1, values within 1e-5 of float64, in the weights' layout and the adapter's B layout; the zmm kernel for B has the
AVX2 kernel's bits; on the zmm paths each attention score of a block of keys has the bits of that key scored
alone); ``auto`` skips a path that fails, saying so in :func:`status`'s reason.

``MTP_AMX_EMULATE=1`` with ``MTP_KERNELS=amx`` builds the AMX path with the tile instructions written out in
plain C++ (same data movement, per-element order and rounding; shape errors abort): it tests the AMX code on a
CPU with AVX512-BF16 but without AMX, ~100x slower. ``auto`` never picks it.
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
from .abi import Batch, Layer, Linear, Model, bind, check_layout  # noqa: F401  (the ctypes structs: K.Linear, ...)

__all__ = ["KernelError", "KernelStatus", "build", "candidates", "choose_isa", "cpu_flags", "emulating", "missing",
           "requested", "runnable", "status"]

ENV = "MTP_KERNELS"
CHOICES = ("auto", "amx", "avx512bf16", "avx2", "off")
SOURCE = Path(__file__).with_name("mtp_kernels.cpp")


def sources() -> list[Path]:
    """Every file of the one translation unit: ``mtp_kernels.cpp`` and the ``mtp_*.h`` parts it includes."""
    return [SOURCE] + sorted(SOURCE.parent.glob("mtp_*.h"))
EMULATE_ENV = "MTP_AMX_EMULATE"
ISA_CODES = {"avx2": 1, "avx512bf16": 2, "amx": 3}
#: CPU flags (``/proc/cpuinfo``) each path needs.
NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
}
NEEDS["amx"] = NEEDS["avx512bf16"] + ("amx_tile", "amx_bf16")
#: ``auto``'s order of preference.
PREFERENCE = ("amx", "avx512bf16", "avx2")
CFLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]


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


def emulating() -> bool:
    """Whether ``MTP_AMX_EMULATE`` asks for the AMX path in emulation (a test of the AMX code without AMX)."""
    return os.environ.get(EMULATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def runnable(isa: str, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU runs path ``isa``: natively, or (``amx`` with :func:`emulating`) in emulation, which
    needs what ``avx512bf16`` needs."""
    if isa == "amx" and emulating():
        return not missing("avx512bf16", flags)
    return not missing(isa, flags)


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
    """The first kernel path to try for ``value`` (default: :func:`requested`) on a CPU with ``flags``:
    ``"amx"``, ``"avx512bf16"``, ``"avx2"``, or None (``off``, or ``auto`` on a CPU with none of them).

    Raises:
        KernelError: a forced path this CPU cannot run (the message names the missing instructions).
    """
    return (candidates(value, flags) or [None])[0]


def candidates(value: str | None = None, flags: frozenset[str] | None = None) -> list[str]:
    """The paths :func:`status` tries in order: the forced one, or for ``auto`` every path the CPU has, best
    first (never the emulated AMX path); empty for ``off``.

    Raises:
        KernelError: a forced path this CPU cannot run.
    """
    value = requested() if value is None else value
    if value == "off":
        return []
    if value == "auto":
        return [isa for isa in PREFERENCE if not missing(isa, flags)]
    if not runnable(value, flags):
        lack = missing("avx512bf16" if value == "amx" and emulating() else value, flags)
        raise KernelError(f"{ENV}={value}: this CPU lacks {', '.join(lack)} ({ENV}=auto runs the best path it has)")
    return [value]


# ------------------------------------------------------------------------------------------- building
def cache_dir() -> Path:
    """Where built kernels live: ``$MTP_KERNELS_DIR``, default ``~/.cache/mtp-lm/kernels`` (not under
    ``$MTP_CACHE_DIR``, which tests point at empty folders for model copies: the kernels stay built)."""
    return Path(os.environ.get("MTP_KERNELS_DIR") or Path.home() / ".cache" / "mtp-lm" / "kernels")


def cflags(emulate: bool = False) -> list[str]:
    """The compiler's flags (with ``-DMTP_AMX_EMULATE`` for the emulated AMX build)."""
    return CFLAGS + (["-DMTP_AMX_EMULATE"] if emulate else [])


def library_path(emulate: bool = False) -> Path:
    """The built library for this source and these flags (its name carries their hash)."""
    text = b"".join(p.read_bytes() for p in sources()) + " ".join(cflags(emulate)).encode()
    h = hashlib.sha256(text).hexdigest()[:16]
    return cache_dir() / f"libmtp_kernels-{h}.so"


def compiler() -> str | None:
    """The C++ compiler to build with (``$CXX``, else ``g++``), or None when there is none."""
    cxx = os.environ.get("CXX", "g++")
    return shutil.which(cxx)


def build(quiet: bool = False, emulate: bool = False) -> Path:
    """Compile ``mtp_kernels.cpp`` into :func:`library_path` unless it is there; returns the path.
    ``emulate``: the build whose AMX path is emulated (:func:`emulating`).

    Writes to a temporary file and renames it, so concurrent builds (test workers) never load half a file.

    Raises:
        KernelError: no compiler, or the compiler failed (its first lines of errors in the message).
    """
    out = library_path(emulate)
    if out.is_file() and out.stat().st_size > 0:
        return out
    cxx = compiler()
    if cxx is None:
        name = os.environ.get("CXX") or "g++"
        raise KernelError(f"no C++ compiler ({name}: not found): install g++ (or set CXX) to build our kernels")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except OSError as e:
        blocker = next((p for p in (out.parent, *out.parent.parents) if p.exists()), None)
        why = f"{blocker} is a file" if blocker is not None and not blocker.is_dir() else (e.strerror or str(e))
        raise KernelError(f"cannot write the kernel library into {out.parent} ({why}): set "
                          "MTP_KERNELS_DIR to a folder you can write") from e
    os.close(fd)
    if not quiet:
        print(f"mtp kernels: compiling {SOURCE.name} once into {out.parent} (~8 s)", file=sys.stderr, flush=True)
    try:
        try:
            proc = subprocess.run([cxx, *cflags(emulate), "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                                  timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelError(f"compiling our kernels failed: {cxx}: {e}") from e
        if proc.returncode != 0:
            err = " | ".join(proc.stderr.strip().splitlines()[:3]) or "no message"
            raise KernelError(f"compiling our kernels failed ({cxx} exited with code {proc.returncode}): {err} "
                              "(g++ 11 or later builds them; CXX names another compiler)")
        try:
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of a shared MTP_KERNELS_DIR out
            os.replace(tmp, out)
        except OSError as e:
            raise KernelError(f"cannot write the kernel library {out} ({e.strerror or e})") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@dataclass(frozen=True)
class KernelStatus:
    """Which kernel path this process runs and why.

    Attributes:
        isa: ``"amx"``, ``"avx512bf16"``, ``"avx2"`` or None (the library path runs).
        reason: one line: the path and what chose it (and what ``auto`` passed over, and why), or why ours
            cannot run.
        library: the loaded ``ctypes.CDLL`` (None when ``isa`` is None).
        emulated: the AMX path runs in software emulation (:func:`emulating`).
    """

    isa: str | None
    reason: str
    library: ctypes.CDLL | None = None
    emulated: bool = False


_STATUS: dict[tuple[str, str, bool], KernelStatus] = {}
_LIBRARIES: dict[tuple[str, bool], ctypes.CDLL] = {}
_BUILD_ERRORS: dict[tuple[str, bool, str], str] = {}


def _load(emulate: bool) -> ctypes.CDLL:
    """The built library (built first when needed), loaded once per process and build. A library file that does
    not load (a build cut short, a file damaged since) is deleted and built again, once. A build that failed is
    not tried again in this process (``auto`` tries several paths of the same library).

    Raises:
        KernelError: no compiler, a failed build, or a library that does not load even when built anew.
    """
    path = library_path(emulate)
    key = (str(path), emulate)
    failed = (str(path), emulate, os.environ.get("CXX", ""))
    if failed in _BUILD_ERRORS:
        raise KernelError(_BUILD_ERRORS[failed])
    if key not in _LIBRARIES:
        try:
            built = build(emulate=emulate)  # a failed build raises here and is not tried again
            try:
                lib = _open(built)
            except KernelError:
                built.unlink()
                lib = _open(build(emulate=emulate))
        except OSError as e:
            _BUILD_ERRORS[failed] = f"the kernel library {path} does not load and cannot be deleted ({e}): delete it"
            raise KernelError(_BUILD_ERRORS[failed]) from e
        except KernelError as e:
            _BUILD_ERRORS[failed] = str(e)
            raise
        _LIBRARIES[key] = lib
    return _LIBRARIES[key]


def _open(path: Path) -> ctypes.CDLL:
    """``path`` loaded and bound.

    Raises:
        KernelError: the file does not load, or its structs differ from the ctypes mirror (:mod:`.abi`).
    """
    try:
        lib = bind(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as e:
        raise KernelError(f"loading our kernels failed: {e}") from e
    check_layout(lib, path)
    return lib


_SELFTEST_FAILURES = {1: "a row of a wide product differs from its one-row product", 2: "2 threads differ from 1",
                      3: "a product is off the float64 reference", 4: "out of memory",
                      5: "its adapter-factor kernel differs from the AVX2 kernel's bits",
                      6: "an attention score of a block of keys differs from the key's score alone",
                      7: "a bf16 model's weighted values differ from their float64 sum"}


def _ready(isa: str, emulate: bool) -> ctypes.CDLL:
    """Path ``isa`` loaded and checked: for ``amx``, built and granted the tile state; then its self-check.

    Raises:
        KernelError: why this path cannot run here.
    """
    lib = _load(emulate)
    if isa == "amx":
        if lib.mtp_amx_built() == 0:
            raise KernelError("the compiler cannot build AMX code (g++ 11 or clang 12 needed)")
        err = lib.mtp_amx_init()
        if err:
            raise KernelError(f"Linux refused the AMX tile state ({os.strerror(err) if err > 0 else err}; "
                              f"kernel 5.16 or later needed)")
    rc = lib.mtp_selftest(ISA_CODES[isa])
    if rc:
        raise KernelError(f"our {isa} kernel failed its self-check: {_SELFTEST_FAILURES.get(rc, f'code {rc}')}")
    return lib


def status() -> KernelStatus:
    """The kernel path for the current ``MTP_KERNELS`` (built, loaded and checked on first call; cached per
    value). ``auto`` tries :func:`candidates` in order and runs the first that passes.

    Raises:
        KernelError: a forced path this CPU cannot run, an unknown value, or a forced path whose build, tile
            permission or self-check failed.
    """
    value = requested()
    emulate = value == "amx" and emulating()
    key = (value, os.environ.get("MTP_KERNELS_DIR", ""), emulate)
    if key in _STATUS:
        return _STATUS[key]
    tries = candidates(value)
    if not tries:
        why = (f"{ENV}=off" if value == "off" else
               "this CPU has neither AVX2+FMA nor AVX512-BF16 (" + ", ".join(missing("avx2")) + " missing)")
        st = KernelStatus(None, why)
    else:
        st, passed_over = None, []
        for isa in tries:
            try:
                lib = _ready(isa, emulate)
            except KernelError as e:
                if value != "auto":
                    raise KernelError(f"{ENV}={value}: {e}") from e
                passed_over.append(f"{isa}: {e}")
                continue
            how = "forced" if value != "auto" else "auto"
            if emulate:
                how += f", AMX emulated in software ({EMULATE_ENV}=1): slow, for testing"
            if passed_over:
                how += "; passed over " + "; ".join(passed_over)
            st = KernelStatus(isa, f"our kernels, {isa} ({how})", lib, emulated=emulate)
            break
        if st is None:
            reasons = {e.split(": ", 1)[1] for e in passed_over}
            st = KernelStatus(None, "our kernels unavailable: " + (reasons.pop() if len(reasons) == 1 else
                                                                   "; ".join(passed_over)))
            print(f"mtp kernels: {st.reason}; the torch path runs", file=sys.stderr, flush=True)
    _STATUS[key] = st
    return st
