"""Which floating-point precision a device runs fast: one place for training and inference.

bfloat16 is the natural compute type on CUDA GPUs and on CPUs with native bf16 instructions
(x86 AVX512-BF16 or AMX-BF16; Arm's BF16 extension). There, bf16 matrix products run at 2-3x the
float32 speed (measured on an AMD EPYC with AVX512-BF16, one thread, SmolLM2-135M: training step
2.5x, no-grad forward 3x). On CPUs without them torch emulates bf16 through float32 conversions,
which is *slower* than float32, so ``auto`` must not pick bf16 there.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path

import torch

ENV_OVERRIDE = "MTP_NATIVE_BF16"
_X86_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=None)
def _cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="ignore")
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "flags" and any(f in value.split() for f in _X86_FLAGS):  # x86 Linux
            return True
        if key == "features" and "bf16" in value.split():  # aarch64 Linux (ARMv8.6 BF16)
            return True
    if not cpuinfo and platform.system() == "Darwin":  # Apple silicon M2 and later
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
            return out == "1"
        except (OSError, subprocess.SubprocessError):
            return False
    return False


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """True when ``device`` computes in bfloat16 natively (fast), so ``auto`` precision should pick it.

    * CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and later).
    * CPU: the processor advertises bf16 instructions — x86 ``avx512_bf16`` or ``amx_bf16`` (Linux
      ``/proc/cpuinfo`` flags), Arm ``bf16`` (Linux features) or ``hw.optional.arm.FEAT_BF16`` (macOS).
      Without them torch emulates bf16 and it runs slower than float32.
    * anything else (mps, ...): False.

    The environment variable ``MTP_NATIVE_BF16=1`` / ``0`` overrides the answer for every device
    (e.g. to compare precisions on the same machine).
    """
    forced = os.environ.get(ENV_OVERRIDE, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if dev.type == "cpu":
        return _cpu_has_bf16()
    return False
