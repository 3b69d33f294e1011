"""Threads beside our kernels: torch's own CPU ops run serially during an engine step (paper 3.4: the forward pass
is what MTP decoding is made of, so nothing may slow it down).

Our kernels (:mod:`model.engine.kernels`) run on their own thread pool, with as many threads as torch is set to use
(``torch.set_num_threads``, the CLIs' ``--threads``: the one knob). Torch's CPU ops run on OpenMP, whose idle
threads spin after every parallel region before they sleep (libgomp's default: about 300,000 PAUSE loops, a few
milliseconds). A decoding step calls a few torch ops on the pass's logits (the bf16 rounding, the proposals'
softmax and maximum: 49,152 columns each, enough for torch to split them across threads); each left an OpenMP
thread spinning on the core our pool's worker needed for the next pass. Measured on a 2-core AMD EPYC (Zen 4),
SmolLM2-135M bf16, torch at two threads: one-token passes 10.5-13.3 ms (8.4-9.1 ms at one thread); with torch's
ops serial 5.6-6.8 ms; standard decoding 83 -> 127-130 tokens/s.

So an engine step on our kernels (:meth:`~model.engine.loaded_model.LoadedModel.engine_step`: a forward pass and
the acceptance of its proposals) runs inside :func:`serial_torch`: torch's ops there stay on the calling thread (they
touch one pass's rows: tens of microseconds), the OpenMP team stays asleep, and :func:`kernel_threads` hands the
count that was set to the kernels. Steps on the other backends (torch ops do the forward pass there) are left as
they are.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch

_state = threading.local()


def kernel_threads() -> int:
    """Threads for our kernels' next pass started from this thread: torch's thread count as it was set outside
    :func:`serial_torch` (inside it torch itself is held at 1)."""
    return getattr(_state, "threads", 0) or torch.get_num_threads()


@contextmanager
def serial_torch() -> Iterator[None]:
    """Inside: torch's CPU ops started from this thread run on it alone (``torch.set_num_threads(1)``: no OpenMP
    region, so no spinning OpenMP thread afterwards), while :func:`kernel_threads` still returns the count set
    before. Nested uses cost nothing; torch's count is restored on the way out, exceptions included.

    ``torch.set_num_threads`` also sets the count that threads starting their first torch op meanwhile adopt:
    a thread of the process that begins its torch work during a step runs it on one thread (threads already
    running torch keep their own count).
    """
    if getattr(_state, "threads", 0):
        yield
        return
    n = torch.get_num_threads()
    if n <= 1:
        yield
        return
    _state.threads = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _state.threads = 0
