"""The C interface of our kernels as ``ctypes`` sees it: the structs ``mtp_kernels.cpp`` takes, the functions'
signatures, and a check of the one against the other.

The structs are written twice, once in C and once here. Instead of a version number kept equal by hand on both
sides, the library lists every field of its structs with its offset and size (``mtp_fields``), and
:func:`check_layout` compares that list with the ``ctypes`` classes below when the library loads: a field added,
moved or retyped on one side only is refused there with its name, never read at the wrong place.
"""

from __future__ import annotations

import ctypes

from ...errors import KernelError


class Linear(ctypes.Structure):
    """``mtp_linear``: one projection (a group of stacked ones) and its adapter's factors."""

    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("layout", ctypes.c_int32),
                ("bias", ctypes.c_void_p), ("rank", ctypes.c_int32), ("lora_a", ctypes.c_void_p),
                ("lora_a_in_w", ctypes.c_int32), ("members", ctypes.c_int32), ("m_out0", ctypes.c_int32 * 4),
                ("m_out1", ctypes.c_int32 * 4), ("m_r0", ctypes.c_int32 * 4), ("m_r1", ctypes.c_int32 * 4),
                ("m_b", ctypes.c_void_p * 4), ("lora_layout", ctypes.c_int32)]


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


#: The mirrored structs by their C names.
MIRRORS: dict[str, type[ctypes.Structure]] = {"mtp_linear": Linear, "mtp_layer": Layer, "mtp_model": Model,
                                              "mtp_batch": Batch}


class _Field(ctypes.Structure):
    """``mtp_field``: one entry of the library's own list of its struct fields."""

    _fields_ = [("name", ctypes.c_char_p), ("offset", ctypes.c_int64), ("size", ctypes.c_int64)]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's functions' signatures on ``lib`` (returned)."""
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.mtp_field_count.restype = i32
    lib.mtp_fields.restype = ctypes.POINTER(_Field)
    lib.mtp_alloc.argtypes, lib.mtp_alloc.restype = [i64], vp
    lib.mtp_free.argtypes, lib.mtp_free.restype = [vp], None
    lib.mtp_packed_bytes.argtypes, lib.mtp_packed_bytes.restype = [i32, i32, i32], i64
    lib.mtp_pack_weight.argtypes, lib.mtp_pack_weight.restype = [vp, i32, i32, i32, i32, vp], None
    lib.mtp_forward_batch.argtypes = [ctypes.POINTER(Model), vp, i32, ctypes.POINTER(Batch), vp, vp, vp, i32, i32]
    lib.mtp_forward_batch.restype = ctypes.c_int
    lib.mtp_amx_built.restype = lib.mtp_amx_init.restype = lib.mtp_selftest.restype = i32
    lib.mtp_selftest.argtypes = [i32]
    lib.mtp_propose.argtypes, lib.mtp_propose.restype = [vp, i32, i32, i64, i64, i64, vp, vp, i32], i32
    lib.mtp_reduced_passes.restype = i64
    lib.mtp_reduced_reset.restype = None
    return lib


def library_layout(lib: ctypes.CDLL) -> dict[str, tuple[int, int]]:
    """The library's structs as it was compiled: ``{"mtp_linear": (-1, sizeof), "mtp_linear.rank": (offset,
    size), ...}`` in bytes."""
    fields = lib.mtp_fields()
    return {fields[i].name.decode(): (fields[i].offset, fields[i].size) for i in range(lib.mtp_field_count())}


def mirror_layout(mirrors: dict[str, type[ctypes.Structure]] = MIRRORS) -> dict[str, tuple[int, int]]:
    """The same map (:func:`library_layout`) for the ``ctypes`` classes."""
    out: dict[str, tuple[int, int]] = {}
    for cname, cls in mirrors.items():
        out[cname] = (-1, ctypes.sizeof(cls))
        for name, _ in cls._fields_:
            desc = getattr(cls, name)
            out[f"{cname}.{name}"] = (desc.offset, desc.size)
    return out


def layout_differences(library: dict[str, tuple[int, int]], mirror: dict[str, tuple[int, int]]) -> list[str]:
    """Where the two maps (:func:`library_layout`, :func:`mirror_layout`) disagree, one line per name; empty when
    they agree."""
    out = []
    for name in sorted(set(library) | set(mirror)):
        c, py = library.get(name), mirror.get(name)
        if c == py:
            continue
        if c is None or py is None:
            out.append(f"{name} only in {'the ctypes mirror' if c is None else 'the library'}")
        else:
            what = "size" if c[0] < 0 else "offset, size"
            out.append(f"{name}: {what} {c if c[0] >= 0 else c[1]} in the library, {py if py[0] >= 0 else py[1]} "
                       "in the ctypes mirror")
    return out


def check_layout(lib: ctypes.CDLL, path: object = "") -> None:
    """Refuse a library whose structs differ from the ``ctypes`` mirror.

    Raises:
        KernelError: naming the first fields that differ.
    """
    diff = layout_differences(library_layout(lib), mirror_layout())
    if diff:
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise KernelError(f"the kernel library {path} does not match its ctypes mirror: " + "; ".join(diff[:3]) + more)
