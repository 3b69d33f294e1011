"""Memory (defect 6): what the page keeps is bounded, and a long conversation does not grow the process.

* 50 turns in one session (a tiny random model on the real pass loop, never a mock) leave the resident set within
  :data:`TURNS_MARGIN_MB` of where it stood after a few warm-up turns;
* the sessions keep at most :data:`~app.sessions.MAX_SESSIONS_KEPT` conversations and
  :data:`~app.sessions.MAX_POINTS_KEPT` answer points each, and at most :data:`~app.sessions.MAX_KEPT_CHARS`
  characters of conversation in all;
* the registry keeps at most its capacity of models, and :class:`~app.device.ModelFacts` what it measured of at
  most :data:`~app.device.MAX_FACTS_KEPT` models;
* our kernels' packed weights take about their own size (:data:`model.engine.kernel_forward.SLAB_BYTES`), not
  2 MB per buffer.

RSS is read after ``gc.collect()`` and glibc's ``malloc_trim(0)`` (where there is glibc): what the process holds,
not what the allocator keeps cached for reuse, which differs between allocators and machines.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import types
import weakref
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

import torch

from app.device import MAX_FACTS_KEPT, ModelFacts, WidthProfile
from app.outputs import TURN_OUTPUTS
from app.page import Page
from app.registry import ModelRegistry
from app.sessions import MAX_KEPT_CHARS, MAX_POINTS_KEPT, MAX_SESSIONS_KEPT, MESSAGE_CHARGE, SessionRuns
from model.engine.kernel_forward import SLAB_BYTES, KernelForward
from model.errors import CheckpointError, RequestError
from model.evaluation.sweep import AnswerPoint

#: Warm-up turns before the resident set is read the first time: the pass loop's thread, the kernels' scratch
#: buffers, the tokenizer's and the figures' caches reach their size in the first turns.
WARMUP_TURNS = 5
#: Turns measured after the warm-up (one session, one conversation that grows with every turn).
TURNS = 50
#: Growth of the resident set allowed over those turns. What they must keep is a conversation of 100 messages
#: and 50 answer points (well under 1 MB) and a KV cache a few kB longer per turn; measured here: 6-20 MB
#: (2-core AMD EPYC, glibc, Python 3.11; the allocator's own bookkeeping and the tokenizer's caches). The margin
#: leaves room for other allocators and CPUs; a leak of 1.3 MB a turn or more still fails it (defect 6 grew
#: ~2.3 GB in 40 minutes).
TURNS_MARGIN_MB = 64
KEY = ("tiny", "none", "auto")


def _libc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_TRIM = _libc_trim()


def rss_mb() -> float:
    """The resident set in MB after a full collection (and glibc's trim of its free pages)."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)
    return psutil.Process().memory_info().rss / 2**20


def _turn(page: Page, i: int, session: str = "s1") -> dict:
    *_, last = page.chat(f"Question {i}: count to three.", [], "ConfAdapt", 0.9, 4, 3, 12, "linear", KEY,
                         request=types.SimpleNamespace(session_hash=session))  # the page's own turn: recorded per session
    return dict(zip(TURN_OUTPUTS, last))


def test_fifty_turns_in_one_session_keep_the_resident_set_within_the_margin(tiny_registry):
    page = Page(tiny_registry, SessionRuns(), preload=False)
    for i in range(WARMUP_TURNS):
        _turn(page, i)
    before = rss_mb()
    for i in range(WARMUP_TURNS, WARMUP_TURNS + TURNS):
        out = _turn(page, i)
        assert "done" in str(out["status"]), out["status"]  # every turn answered (none refused as too long)
    after = rss_mb()
    kept = page.sessions.conversation("s1", [])
    assert len(kept) == 2 * (WARMUP_TURNS + TURNS)
    assert len(page.sessions.points("s1")) == WARMUP_TURNS + TURNS
    print(f"RSS {before:.1f} MB after {WARMUP_TURNS} turns, {after:.1f} MB after {TURNS} more "
          f"(+{after - before:.1f} MB; margin {TURNS_MARGIN_MB} MB)")
    assert after - before <= TURNS_MARGIN_MB


def test_sessions_keep_a_bounded_number_of_conversations_and_points():
    runs = SessionRuns()
    point = AnswerPoint(("tiny", "none", "auto"), 1, "ConfAdapt tau 0.9", "confadapt", 0.9, 1.5, True)
    for s in range(300):
        runs.remember(f"s{s}", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
        runs.add_point(f"s{s}", point)
    for _ in range(MAX_POINTS_KEPT + 50):
        runs.add_point("s299", point)
    assert len(runs._conversations) == MAX_SESSIONS_KEPT and len(runs._points) == MAX_SESSIONS_KEPT
    assert runs.conversation("s0", []) == [] and runs.points("s0") == []  # the oldest forgotten
    assert len(runs.conversation("s299", [])) == 2
    assert len(runs.points("s299")) == MAX_POINTS_KEPT


def test_sessions_keep_a_bounded_number_of_characters_in_all():
    runs = SessionRuns()
    text = "x" * 100_000  # a long answer on both sides: ~200k characters a conversation
    conversation = [{"role": "user", "content": "Write a lot."}, {"role": "assistant", "content": text, "mtp": text}]
    charge = 2 * MESSAGE_CHARGE + sum(len(v) for m in conversation for v in m.values())  # roles too
    for s in range(100):
        runs.remember(f"s{s}", conversation)
        assert runs.kept_chars() <= MAX_KEPT_CHARS
    kept = MAX_KEPT_CHARS // charge
    assert len(runs._conversations) == kept and runs.kept_chars() == kept * charge
    assert runs.conversation("s99", []) == conversation  # the most recent ones are kept
    assert runs.conversation(f"s{99 - kept}", []) == []  # the oldest forgotten first
    runs.remember("s99", [])  # Clear: its characters are freed
    assert runs.kept_chars() == (kept - 1) * charge
    huge = [{"role": "user", "content": "y" * (MAX_KEPT_CHARS + 1)}]
    runs.remember("big", huge)  # one conversation over the budget alone: kept (its turn continues it), alone
    assert list(runs._conversations) == ["big"] and runs.conversation("big", []) == huge


def _raising_loader(source, quantization=None, dtype=None):
    raise CheckpointError(f"No such local model: {source}.")


def test_the_registry_keeps_its_capacity_of_models_and_no_lock_per_source(tiny_registry):
    first = weakref.ref(tiny_registry.get("a"))
    tiny_registry.get("b")
    tiny_registry.get("c")
    assert tiny_registry.loaded() == [("b", "none", "auto"), ("c", "none", "auto")]
    gc.collect()
    assert first() is None  # the model evicted is freed: nothing else holds it
    assert tiny_registry._loading == {}
    failing = ModelRegistry(loader=_raising_loader)
    for i in range(50):  # mistyped sources leave nothing behind
        with pytest.raises(RequestError):
            failing.get(f"missing-{i}")
    assert failing._loading == {} and failing.loaded() == []


def test_model_facts_are_kept_for_a_bounded_number_of_models():
    facts = ModelFacts(threading.Lock())
    profile = WidthProfile({1: 0.01, 2: 0.012}, "cpu", "float32", False)
    keys = [(f"m{i}", "none", "auto") for i in range(MAX_FACTS_KEPT + 10)]
    for key in keys:
        facts.put_profile(key, profile)
        facts.profile(keys[0])  # the first model stays in use
    kept = facts.kept()
    assert kept == keys[-(MAX_FACTS_KEPT - 1):] + [keys[0]]  # least recently used first
    assert facts.profile(keys[1]) is None and facts.profile(keys[-1]) == profile


def _kernel_lm(registry):
    lm = registry.get("tiny")
    if not isinstance(lm.fast_engine(), KernelForward):
        pytest.skip(f"our kernels do not run here: {lm.forward_path}")
    return lm


def test_packed_weights_take_about_their_size(tiny_registry):
    arena = _kernel_lm(tiny_registry).fast_engine().arena
    # 8 packed projections under 2 MB (2 layers x qkv, o, gate_up, down) share one slab, not 2 MB apiece; the
    # 12.6 MB head has its own buffer
    head = arena.lib.mtp_packed_bytes(49153, 64, 0)
    assert len(arena.blocks) == 2 and arena.allocated == SLAB_BYTES + -(-head // (2 << 20)) * (2 << 20)


def test_a_long_pass_leaves_no_scratch_in_a_thread_that_lives_on(tiny_registry):
    """A scoring pass keeps the logits of hundreds of rows: ~300 MB of the kernels' scratch for the tiny model's
    49k-token vocabulary. A web server's worker thread that ran one must not keep it."""
    lm = _kernel_lm(tiny_registry)
    ids = lm.literal_ids("one two three four five six seven eight nine ten " * 100)[:1000]

    def long_pass() -> None:
        logits = lm.forward(torch.tensor([ids]), lm.new_cache(), num_masks=0, logits_to_keep=len(ids))
        assert logits.shape[1] == len(ids)

    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # the thread exists before the first reading
        before = rss_mb()
        pool.submit(long_pass).result()
        after = rss_mb()  # the thread is still alive
    print(f"RSS {before:.1f} MB before a 1000-row pass in a worker thread, {after:.1f} MB after")
    assert after - before < 64
