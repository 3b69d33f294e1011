"""Threads beside our kernels (model.engine.threads): during an engine step torch's ops run on the calling thread
and our kernels get the thread count torch was set to; on the other backends a step changes nothing."""

from __future__ import annotations

import ctypes

import pytest
import torch

from model.engine import kernels as K
from model.engine.batch import BatchRunner
from model.engine.decoding import Decoder, run
from model.engine.strategies import confadapt, standard
from model.engine.threads import kernel_threads, serial_torch
from tests.engine.test_kernels import PROMPT, _tiny, on_kernels


@pytest.fixture
def two_torch_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_serial_torch_holds_torch_at_one_thread_and_gives_the_count_to_the_kernels(two_torch_threads):
    assert kernel_threads() == 2
    with serial_torch():
        assert torch.get_num_threads() == 1 and kernel_threads() == 2
        with serial_torch():  # nested: unchanged
            assert torch.get_num_threads() == 1 and kernel_threads() == 2
        assert torch.get_num_threads() == 1 and kernel_threads() == 2
    assert torch.get_num_threads() == 2 and kernel_threads() == 2
    with pytest.raises(KeyError):
        with serial_torch():
            raise KeyError("boom")
    assert torch.get_num_threads() == 2 and kernel_threads() == 2
    torch.set_num_threads(1)
    with serial_torch():
        assert torch.get_num_threads() == 1 and kernel_threads() == 1


@pytest.mark.skipif(bool(K.missing("avx2")), reason="this CPU lacks AVX2")
def test_kernel_steps_run_torch_serially_and_the_kernels_on_every_thread(base_tokenizer, monkeypatch,
                                                                         two_torch_threads):
    lm = on_kernels(_tiny(base_tokenizer, dtype=torch.bfloat16, adapter="alora"), "avx2", monkeypatch)
    engine = lm.fast_engine()
    seen: list[tuple[int, int]] = []  # (threads handed to the kernel, torch's count meanwhile)
    inner = engine._forward_batch

    def spy(inputs, threads):
        seen.append((threads, torch.get_num_threads()))
        return inner(inputs, threads)

    monkeypatch.setattr(engine, "_forward_batch", spy)
    proposing: list[int] = []  # torch's count while a step picks its proposals from the logits
    from model.engine import decoding

    def propose(logits, mask_token_id, backend=None):
        proposing.append(torch.get_num_threads())
        return decoding_propose(logits, mask_token_id, backend)

    decoding_propose = decoding.propose
    monkeypatch.setattr(decoding, "propose", propose)
    ids = lm.prompt_ids(PROMPT)
    dec = Decoder(lm, ids, confadapt(0.9, 4), 12)
    while dec.prefill_left:
        dec.prefill_chunk(4)
    rec = dec.run_pass()
    assert torch.get_num_threads() == 2
    runner = BatchRunner(lm)
    runner.add(Decoder(lm, ids, standard(), 6))
    runner.add(Decoder(lm, ids, confadapt(0.9, 4), 6))
    runner.run()
    assert torch.get_num_threads() == 2
    assert len(seen) >= 4 and all(s == (2, 1) for s in seen), seen
    assert len(proposing) >= 3 and set(proposing) == {1}, proposing
    # the same tokens as one thread gives (threads split columns, never a sum)
    got = run(lm, ids, confadapt(0.9, 4), 12).token_ids
    torch.set_num_threads(1)
    assert run(lm, ids, confadapt(0.9, 4), 12).token_ids == got
    assert rec.kept == got[:len(rec.kept)]


def test_library_steps_keep_torch_threads(base_tokenizer, two_torch_threads):
    from transformers import DynamicCache

    lm = _tiny(base_tokenizer, dtype=torch.float32, adapter="alora")
    cache = DynamicCache(config=lm.model.config)  # the library backend's cache
    with lm.engine_step(cache):
        assert torch.get_num_threads() == 2


@pytest.mark.skipif(bool(K.missing("avx2")), reason="this CPU lacks AVX2")
def test_a_worker_that_loses_its_core_leaves_the_next_passes_a_thread_fewer(base_tokenizer, monkeypatch,
                                                                          two_torch_threads):
    """A worker that loses its core mid-share (another program on it; here the library's test hook sleeps 2 ms
    after each share a worker claims) stalls its regions: after such a pass, the passes of the next half second
    run on a thread fewer, here the calling thread alone. The tokens stay those of an undisturbed run."""
    lm = on_kernels(_tiny(base_tokenizer, dtype=torch.bfloat16, adapter="alora"), "avx2", monkeypatch)
    lib = K._load(False)
    delay = ctypes.c_int64.in_dll(lib, "mtp_debug_share_delay_ns")
    ids = lm.prompt_ids(PROMPT)
    lib.mtp_reduced_reset()
    want = run(lm, ids, confadapt(0.9, 4), 12).token_ids
    before = lib.mtp_reduced_passes()
    delay.value = 2_000_000
    try:
        got = run(lm, ids, confadapt(0.9, 4), 12).token_ids
    finally:
        delay.value = 0
        lib.mtp_reduced_reset()
    assert got == want
    assert lib.mtp_reduced_passes() > before
