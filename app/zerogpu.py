"""ZeroGPU: how long a turn asks for the GPU, and running a function on it (Hugging Face Spaces).

On a ZeroGPU Space the GPU exists only inside a function decorated with ``spaces.GPU``, which runs in a worker
forked from the page's process; anywhere else the decorator is not applied and the function runs as it is.
"""

from __future__ import annotations

from typing import Callable

import spaces  # ZeroGPU's decorator; a no-op anywhere else (app.py imports it before torch)

from model.engine.presets import preset_by_name

from .requests import APP_MAX_K_MAX, APP_MAX_NEW_TOKENS, DEFAULT_MAX_NEW_TOKENS, TurnRequest

#: Seconds a ZeroGPU request may hold the GPU at most (a free visitor's daily quota is 5 minutes).
GPU_SECONDS_MAX = 240
#: What a GPU turn costs besides its passes: a worker's first use (packing the fast path), rendering.
GPU_SECONDS_OVERHEAD = 10.0
#: Seconds of one forward pass on a GPU at batch 1: kernel launches dominate a model of this project's size;
#: a larger model adds the time to read its weights (~2 TB/s).
GPU_PASS_SECONDS = 0.03
GPU_READ_BYTES_PER_SECOND = 2e12


#: Seconds a ZeroGPU worker is asked for to measure the trade-off (the example prompts, few taus).
GPU_SWEEP_SECONDS = 120


def gpu_seconds(request: TurnRequest) -> int:
    """The GPU time a turn asks ZeroGPU for, from the turn's own request (``spaces.GPU``'s ``duration`` callable:
    it runs in the main process before the GPU is granted, so it only reads).

    Both sides may take up to ``max_new_tokens`` passes (the MTP side fewer); a pass costs
    :data:`GPU_PASS_SECONDS` plus the model's weights read at :data:`GPU_READ_BYTES_PER_SECOND`, and 1%
    more per token fed (``2 k_max`` for the linear layout, ``k_max²`` for a tree; a wider pass costs little more
    on a GPU at batch 1). A short answer asks for little and so queues first; the result is clamped to
    [15, :data:`GPU_SECONDS_MAX`] seconds. The overhead covers measuring the width profile on first use."""
    try:
        n = min(max(int(float(request.max_new_tokens)), 1), APP_MAX_NEW_TOKENS)
    except (TypeError, ValueError):
        n = DEFAULT_MAX_NEW_TOKENS
    preset = preset_by_name(str(request.key[0]))
    size = preset.weight_bytes if preset is not None else 0
    try:
        km = min(max(int(float(request.k_max)), 1), APP_MAX_K_MAX)
    except (TypeError, ValueError):
        km = APP_MAX_K_MAX
    tree = str(request.shape or "linear").strip().lower() not in ("linear", "")
    width = km * km if tree else 2 * km  # lossless feeds drafts + a block of masks per draft prefix
    per_pass = (GPU_PASS_SECONDS + size / GPU_READ_BYTES_PER_SECOND) * (1 + 0.01 * width)
    return int(min(GPU_SECONDS_MAX, max(15.0, GPU_SECONDS_OVERHEAD + 2 * n * per_pass)))


def zero_gpu() -> bool:
    """True on a ZeroGPU Space (a GPU exists only inside a function decorated with ``spaces.GPU``)."""
    return bool(spaces.config.Config.zero_gpu)


def on_gpu(fn: Callable, duration: Callable | int) -> Callable:
    """``fn`` run in a ZeroGPU worker with a GPU for ``duration`` seconds (a number, or a callable of ``fn``'s
    arguments) on a ZeroGPU Space; ``fn`` itself anywhere else. The worker is a fork of this process: arguments and
    yields are pickled (plain values only)."""
    return spaces.GPU(duration=duration)(fn) if zero_gpu() else fn
