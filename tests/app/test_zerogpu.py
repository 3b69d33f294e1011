"""ZeroGPU (app/zerogpu.py): the GPU time a turn asks for, and no CUDA at import."""

from __future__ import annotations





# ---------------------------------------------------------- ZeroGPU
def test_gpu_seconds_follow_the_calls_own_arguments():
    """ZeroGPU's duration comes from the turn's arguments: longer answers, wider passes and larger models ask for
    more, within [15 s, the cap]; unreadable values fall back instead of raising (it runs before validation)."""
    from app.requests import TurnRequest
    from app.zerogpu import GPU_SECONDS_MAX, gpu_seconds

    def secs(max_new, k_max=4, source="smollm2-135m", shape="linear"):
        return gpu_seconds(TurnRequest("hi", [], "ConfAdapt", 0.9, k_max, 3, max_new, (source, "none", "auto"), shape))

    big = "jwkirchenbauer/L3-1-8B-Magpie-MTP"
    assert 15 <= secs(16) <= secs(512) <= secs(1024) <= GPU_SECONDS_MAX
    assert secs(1024, source=big) > secs(1024) and secs(256, source=big) > secs(64, source=big)
    assert secs(256, k_max=16, source=big, shape="full tree") >= secs(256, k_max=16, source=big)
    assert 15 <= secs("abc", k_max="x") <= GPU_SECONDS_MAX


def test_nothing_touches_cuda_when_the_app_is_imported():
    """On ZeroGPU the main process must not initialise CUDA: importing the app (and the engine) never does."""
    import subprocess
    import sys

    code = ("import torch\n"
            "def refuse(*a, **k): raise RuntimeError('CUDA initialised at import')\n"
            "torch.cuda._lazy_init = refuse\n"
            "import app, app.ui, app.page, app.turn, app.passes, app.device, model.engine.loading\n"
            "assert not torch.cuda.is_initialized()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=str(__import__("tests.conftest", fromlist=["ROOT"]).ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
