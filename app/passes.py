"""Every forward pass of the page, in one place: sessions that generate at once share passes (paper 3.4).

A turn does not run its passes itself: it hands each decoder's next pass to the :class:`PassScheduler` and waits
for its record. One thread, the pass loop, runs what is waiting: the passes of decoders on the same model that
runs on our CPU kernels go into **one shared forward pass** (:class:`model.engine.batch.BatchRunner`: each
sequence keeps its strategy, KV cache and width, and every row has the bits of a pass of its own, so an answer
is the same whoever shares its passes); anything else (the torch path, a GPU, a single waiting decoder) runs
alone, as a decoder's own :meth:`~model.engine.decoding.Decoder.run_pass`. A session alone on the page
therefore runs exactly as before: one decoder per pass, the two sides alternating.

Honest timing: a pass runs while the scheduler's :attr:`PassScheduler.lock` is held, the lock the page also takes
to render and to score answers, so no pass is timed beside CPU work of the page. Each decoder that rode a shared
pass is charged the whole pass (what its user waited for); its record says how many sequences and rows it
carried (``shared_sequences``, ``shared_rows``). The two sides of one turn never share a pass, so each side's
time stays its own.

A long prompt is fed in chunks first (:meth:`PassScheduler.run_prefill`, each a pass of its own), so that a turn
polling Stop between them waits one chunk at most, never the whole prefill.

After a pass, the loop waits a moment (:data:`GATHER_S`) for the sessions that were in it to hand in their next
pass, so that sessions generating at once keep riding the same passes instead of alternating.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from model.engine.batch import MAX_ROWS, MAX_SESSIONS, BatchRunner
from model.engine.decoding import PREFILL_CHUNK, Decoder, PassRecord

log = logging.getLogger(__name__)

#: Seconds the pass loop waits after a pass for the sessions that were in it to hand in their next pass.
GATHER_S = float(os.environ.get("MTP_APP_GATHER_S", "0.01"))


@dataclass
class _Job:
    """One decoder's next pass, waiting for the loop."""

    decoder: Decoder
    client: object
    done: threading.Event = field(default_factory=threading.Event)
    record: PassRecord | None = None
    error: BaseException | None = None
    prefill: int = 0  # > 0: a chunk of the prompt of at most this many tokens (Decoder.prefill_chunk), run alone
    left: int = 0  # a prefill chunk's result: prompt tokens still to feed


class PassScheduler:
    """Runs the forward passes handed in by every session (module docstring).

    Args:
        max_rows: most rows in one shared pass (:class:`~model.engine.batch.BatchRunner`).
        max_sessions: most sequences in one shared pass.
        gather_s: see :data:`GATHER_S`.
        share: False runs every pass alone (what the page did before passes were shared; benchmarks compare).
    """

    def __init__(self, max_rows: int = MAX_ROWS, max_sessions: int = MAX_SESSIONS, gather_s: float = GATHER_S,
                 share: bool = True):
        self.max_rows, self.max_sessions, self.gather_s, self.share = max_rows, max_sessions, gather_s, share
        self._pid = -1
        self._start()

    def _start(self) -> None:
        """(Re)create the loop's state in this process: a forked worker (ZeroGPU) has no thread of its parent."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._open: set = set()
        self._last: set = set()
        self._thread: threading.Thread | None = None
        #: Shared passes run so far and the sequences they carried (for tests and the log).
        self.shared_passes = 0

    @property
    def lock(self) -> threading.Lock:
        """Held around every pass; hold it to keep passes from running beside CPU-heavy work (rendering)."""
        self._check_process()
        return self._lock

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            self._start()

    @contextlib.contextmanager
    def client(self) -> Iterator[object]:
        """A turn's handle: the loop waits for an open client's next pass after each pass it was in."""
        self._check_process()
        token = object()
        with self._cond:
            self._open.add(token)
        try:
            yield token
        finally:
            with self._cond:
                self._open.discard(token)
                self._last.discard(token)
                self._cond.notify_all()

    def run_prefill(self, decoder: Decoder, client: object = None, chunk: int = PREFILL_CHUNK) -> int:
        """Feed the next chunk of ``decoder``'s prompt (:meth:`~model.engine.decoding.Decoder.prefill_chunk`) in a
        pass of its own; returns the prompt tokens still to feed."""
        return self._submit(_Job(decoder, client, prefill=chunk)).left

    def run_pass(self, decoder: Decoder, client: object = None) -> PassRecord:
        """Run ``decoder``'s next forward pass (alone or shared with other sessions' decoders) and return its
        record.

        Raises:
            Whatever the pass raised (:class:`~model.errors.NonFiniteLogitsError` for this decoder only; another
            exception of a shared pass reaches every decoder in it).
        """
        record = self._submit(_Job(decoder, client)).record
        assert record is not None
        return record

    def _submit(self, job: _Job) -> _Job:
        """Hand ``job`` to the loop and wait for it; raises what its pass raised."""
        self._check_process()
        with self._cond:
            self._queue.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="mtp-pass-loop", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                deadline = time.monotonic() + self.gather_s
                while self._waiting_for() and time.monotonic() < deadline:
                    self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
                jobs, self._queue = self._queue, []
            try:
                with self._lock:
                    ran = self._run(jobs)
            except BaseException as e:  # noqa: BLE001 - never leave a session waiting
                log.exception("the pass loop failed")
                for job in jobs:
                    if job.record is None and job.error is None:
                        job.error = e
                ran = jobs
            with self._cond:
                done = set(map(id, ran))
                self._queue = [j for j in jobs if id(j) not in done and not j.done.is_set()] + self._queue
                self._last = {j.client for j in ran if j.client is not None} & self._open
            for job in ran:
                job.done.set()
            del jobs, ran  # an idle loop holds no decoder (nor its KV cache and model) alive

    def _waiting_for(self) -> bool:
        """An open client of the last pass has not handed in its next pass yet."""
        queued = {j.client for j in self._queue}
        return bool((self._last & self._open) - queued)

    def _run(self, jobs: list[_Job]) -> list[_Job]:
        """Run the jobs' passes: shared per model where our kernels run it, else one by one. Returns the jobs
        that ran (their record or error set)."""
        ran: list[_Job] = []
        groups: dict[int, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(id(job.decoder.lm.model), []).append(job)
        for group in groups.values():
            for job in [j for j in group if j.prefill]:  # prompt chunks run alone: they propose nothing
                group.remove(job)
                self._run_alone(job)
                ran.append(job)
            if not group:
                continue
            runner = self._batch_runner(group) if self.share and len(group) > 1 else None
            if runner is None:
                for job in group:
                    self._run_alone(job)
                    ran.append(job)
                continue
            for job in list(group):
                try:
                    runner.add(job.decoder)
                except ValueError:  # made before the kernels were built: a pass of its own
                    group.remove(job)
                    self._run_alone(job)
                    ran.append(job)
            step = runner.step()
            self.shared_passes += 1
            for job in group:
                if job.decoder in step.records:
                    job.record = step.records[job.decoder]
                elif job.decoder in step.errors:
                    job.error = step.errors[job.decoder]
                else:
                    continue  # over the caps: the next pass takes it
                ran.append(job)
        return ran

    @staticmethod
    def _run_alone(job: _Job) -> None:
        try:
            if job.prefill:
                job.left = job.decoder.prefill_chunk(job.prefill)
                return
            job.record = job.decoder.run_pass()
        except BaseException as e:  # noqa: BLE001 - the turn reports it
            job.error = e

    def _batch_runner(self, group: list[_Job]) -> BatchRunner | None:
        """A batch runner for the group's model, or None where its passes cannot be shared (not our kernels)."""
        try:
            return BatchRunner(group[0].decoder.lm, max_rows=self.max_rows, max_sessions=self.max_sessions)
        except ValueError:
            return None


#: The page's scheduler: every session's passes go through it.
SHARED = PassScheduler()


def exclusive(scheduler: PassScheduler = SHARED) -> threading.Lock:
    """Context in which no forward pass of any session runs (hold it for CPU-heavy rendering)."""
    return scheduler.lock
