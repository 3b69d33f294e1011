"""Which dtype a device computes natively (model/engine/precision.py), and dtype "auto" following it."""

from __future__ import annotations

import torch

from model.engine.loading import resolve_dtype
from model.engine.precision import native_bf16


def test_dtype_auto_follows_native_bf16():
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    assert resolve_dtype(None, torch.device("cpu")) == resolve_dtype("auto", "cpu")
    assert resolve_dtype("float64", "cpu") == torch.float64
