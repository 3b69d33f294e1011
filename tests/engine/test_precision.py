"""Which dtype a device computes natively (model/engine/precision.py), and dtype "auto" following it."""

from __future__ import annotations

import pytest
import torch

from model.engine.loading import resolve_dtype
from model.engine.precision import native_bf16


def test_dtype_auto_follows_native_bf16():
    from model.engine.kernels import status

    want_bf16 = native_bf16("cpu") or status().isa == "avx2"  # our AVX2 kernel: bf16 weights, float32 sums
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if want_bf16 else torch.float32)
    assert resolve_dtype(None, torch.device("cpu")) == resolve_dtype("auto", "cpu")
    assert resolve_dtype("float64", "cpu") == torch.float64


def test_dtype_auto_is_bf16_where_only_our_avx2_kernel_runs(monkeypatch):
    """A CPU without native bf16: bf16 weights when our AVX2 kernel runs the pass (half the bytes of float32,
    float32 accumulation), float32 when it does not (the torch path would emulate bf16 slowly)."""
    from model.engine import kernels

    if kernels.missing("avx2"):
        pytest.skip(f"this CPU lacks {', '.join(kernels.missing('avx2'))}")
    monkeypatch.setenv("MTP_NATIVE_BF16", "0")
    monkeypatch.setenv("MTP_KERNELS", "avx2")
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setenv("MTP_KERNELS", "off")
    assert resolve_dtype("auto", "cpu") == torch.float32
