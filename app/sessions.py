"""The page's sessions: one turn at a time each, in the order their messages came, and what each keeps.

A message sent while the session's previous turn is still answering is not refused: it **waits** for that turn
to end (Stop ends it at once) and then runs as the next turn, continuing the conversation with the previous
turn in it, however that turn ended. This is an ordering, not a timeout: :meth:`SessionRuns.enter` queues the
message, :meth:`RunTicket.wait_turn` returns only once the previous run has ended and recorded its conversation
(:meth:`RunTicket.record`, in the same step as its end). At most :data:`MAX_WAITING` messages wait per session
(one more while its turn is stopping); one more is refused and stays in the box. Clear ends the running turn and empties the conversation; a message
already waiting then starts the new conversation (it was sent, so it is answered, never dropped).

Stop and Clear reach a run through its ticket, in this process, and through a flag file
(:func:`stop_requested`) in any other process on the machine (a ZeroGPU worker is a fork of this one).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

from model.evaluation.sweep import AnswerPoint

log = logging.getLogger(__name__)

#: Where Stop / Clear leave their flag for a run (one file per run). The generation may run in another
#: process (a ZeroGPU worker is a fork of this one): a file on the same machine reaches it there, which a
#: flag in this process's memory would not. Fixed at import, so forked workers share it.
STOP_DIR = Path(tempfile.gettempdir()) / f"mtp-lens-stop-{os.getpid()}"
#: Conversations the server keeps (one per recent session); the oldest session is forgotten first.
MAX_SESSIONS_KEPT = 256
#: Characters of conversation the server keeps over all sessions, each message charged its text (answers of both
#: sides) plus :data:`MESSAGE_CHARGE`; past it the least recently answered sessions are forgotten first (never the
#: one just recorded). A conversation is bounded only loosely by the prompt limit (the MTP answers riding along
#: are not part of the prompt), so the count of sessions alone does not bound the memory: this does, to about
#: 4 bytes a character (~16 MB of text at worst, a few MB of plain English).
MAX_KEPT_CHARS = 4_000_000
#: What a message's dict costs beside its text, in characters (CPython: ~300 bytes per ``{"role", "content"}``).
MESSAGE_CHARGE = 256
#: Answer points kept per session (the trade-off figure).
MAX_POINTS_KEPT = 200
#: Messages that may wait per session behind its running turn (one more while that turn is stopping).
MAX_WAITING = 2


def stop_requested(run_id: str) -> str | None:
    """``"stopped"`` / ``"cleared"`` once Stop / Clear reached run ``run_id`` (from any process), else None."""
    try:
        return (STOP_DIR / run_id).read_text().strip() or "stopped"
    except OSError:
        return None


class RunTicket:
    """One message's place in its session: it waits (:meth:`wait_turn`), runs, and ends (:meth:`release`).

    Attributes:
        run_id: names the run's stop flag (:func:`stop_requested`), for a generation in another process.
        session: the page session it belongs to.
        seq: the page's number for the message (1, 2, ... in the order the user sent them), or None.
        turn_number: set once the turn is prepared.
        started: set when the ticket became the session's run.
        ended: set when the run ended (its conversation recorded).
    """

    def __init__(self, runs: "SessionRuns", session: str, seq: int | None = None):
        self._runs, self.session, self.seq = runs, session, seq
        self.run_id = uuid.uuid4().hex
        self._reason: str | None = None
        self.started = threading.Event()
        self.ended = threading.Event()
        self.turn_number: int | None = None
        self._conversation: list[dict] | None = None

    def wait_turn(self, timeout: float | None = None) -> bool:
        """Block until this ticket is the session's run (the previous run has ended and recorded its
        conversation). True once it is; False after ``timeout`` seconds (None: no limit)."""
        return self.started.wait(timeout)

    def stop_reason(self) -> str | None:
        """``"stopped"`` / ``"cleared"`` once Stop / Clear was pressed, else None (pass to run_turn)."""
        return self._reason

    def request_stop(self, reason: str = "stopped") -> None:
        """Ask the run to end before its next pass (Clear wins over Stop), in this process and in any
        other process that polls :func:`stop_requested`."""
        if self._reason != "cleared":
            self._reason = reason
        try:
            STOP_DIR.mkdir(parents=True, exist_ok=True)
            (STOP_DIR / self.run_id).write_text(self._reason or reason)
        except OSError as e:  # a read-only temp dir: the in-process flag still works
            log.warning("could not write the stop flag of run %s: %s", self.run_id, e)

    def record(self, history: list[dict]) -> None:
        """The conversation with this run's turn in it so far (its message and partial answers; the final one at
        its end): kept for the session when the run ends (:meth:`release`), in the same step, so that the next
        turn, which starts only then, continues it."""
        self._conversation = list(history)

    def release(self) -> None:
        """End the run, or leave the queue if it never ran (idempotent); the next waiting message starts."""
        self._runs._release(self)
        try:
            (STOP_DIR / self.run_id).unlink(missing_ok=True)
        except OSError:
            pass

    def __enter__(self) -> "RunTicket":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class SessionRuns:
    """Each session's running turn, the messages waiting behind it, its conversation as the server saw it end,
    and its trade-off points (module docstring). Bounded: :data:`MAX_SESSIONS_KEPT` sessions and
    :data:`MAX_KEPT_CHARS` characters of conversation in all, :data:`MAX_POINTS_KEPT` points each,
    :data:`MAX_WAITING` waiting messages each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, list[RunTicket]] = {}  # running ticket first, then the waiting ones
        self._conversations: OrderedDict[str, list[dict]] = OrderedDict()
        self._chars: dict[str, int] = {}  # each kept conversation's charge (_charge)
        self._kept_chars = 0  # their sum
        self._points: OrderedDict[str, list[AnswerPoint]] = OrderedDict()
        self._controls: OrderedDict[str, tuple] = OrderedDict()
        self._arrived: OrderedDict[str, set[int]] = OrderedDict()  # the page's message numbers seen per session

    def arrive(self, session: str | None, seq: int | None) -> None:
        """Note that the page's message number ``seq`` reached the server (refused ones too: every message the page
        numbered arrives here first), so that a later one does not wait for it (:meth:`enter`; a refused one then
        calls :meth:`settle`)."""
        if session is None or seq is None:
            return
        with self._lock:
            seen = self._arrived.setdefault(session, set())
            seen.add(int(seq))
            self._arrived.move_to_end(session)
            while len(self._arrived) > MAX_SESSIONS_KEPT:
                self._arrived.popitem(last=False)

    def settle(self, session: str | None) -> None:
        """A numbered message was refused (it arrived but takes no place): start a message held for it, if the
        session is idle and nothing else before that message is still on its way."""
        with self._lock:
            queue = self._queues.get(session) if session is not None else None
            if queue and not any(t.started.is_set() for t in queue) and not self._earlier_missing(session,
                                                                                              queue[0].seq):
                queue[0].started.set()

    def _earlier_missing(self, session: str, seq: int | None) -> bool:
        """(Lock held.) A message the page numbered before ``seq`` has not reached the server yet (the page numbers
        from 1: a session's first event may be its message 2, with message 1 still on its way)."""
        if seq is None:
            return False
        seen = self._arrived.get(session, set())
        return any(n not in seen for n in range(1, seq))

    def enter(self, session: str | None, seq: int | None = None) -> RunTicket | None:
        """A ticket for a new message in ``session``: already started when the session is idle, else waiting
        behind its run (see :meth:`RunTicket.wait_turn`). None when :data:`MAX_WAITING` messages wait already (one
        more while the running turn is stopping: a message sent right after Stop is never refused).
        ``session`` None (an API client without a session) is never queued.

        Messages keep the order the user sent them in: with the page's number ``seq`` (:meth:`arrive`), a message
        goes before the waiting ones numbered after it, and an idle session does not start one while a message
        numbered before it is still on its way (two Enters 25 ms apart may reach the server the other way round);
        :meth:`promote` starts it anyway once that message is late (never arrived)."""
        if session is None:
            ticket = RunTicket(self, f"anonymous-{uuid.uuid4().hex}")
            ticket.started.set()
            return ticket
        with self._lock:
            queue = self._queues.setdefault(session, [])
            stopping = bool(queue) and queue[0].stop_reason() is not None
            if len(queue) - 1 >= MAX_WAITING + stopping:
                return None
            ticket = RunTicket(self, session, seq)
            at = len(queue)
            while at > 0 and not queue[at - 1].started.is_set() and _before(ticket, queue[at - 1]):
                at -= 1
            queue.insert(at, ticket)
            if at == 0 and not self._earlier_missing(session, seq):
                ticket.started.set()
            return ticket

    def promote(self, session: str | None) -> None:
        """Start the first message of an idle session that was held for an earlier one that never arrived (the
        numbers before it are then given up: a later message does not wait for them again)."""
        with self._lock:
            queue = self._queues.get(session) if session is not None else None
            if queue and not any(t.started.is_set() for t in queue):
                if queue[0].seq is not None:
                    self._arrived.setdefault(session, set()).update(range(1, queue[0].seq))
                queue[0].started.set()

    def begin(self, session: str | None) -> RunTicket | None:
        """A started ticket when the session is idle, else None (never waits; tests and tools)."""
        with self._lock:
            if session is not None and self._queues.get(session):
                return None
        return self.enter(session)

    def current(self, session: str | None) -> RunTicket | None:
        """The session's running ticket, if any."""
        with self._lock:
            queue = self._queues.get(session) if session is not None else None
            return queue[0] if queue else None

    def waiting(self, session: str | None) -> int:
        """Messages of the session waiting behind its running turn."""
        with self._lock:
            return max(0, len(self._queues.get(session, ())) - 1) if session is not None else 0

    def request_stop(self, session: str | None, reason: str = "stopped", upto: int | None = None) -> bool:
        """Ask the session's running turn to end (``"stopped"`` or ``"cleared"``); False if none runs. Waiting
        messages are not touched: the next one starts when the run has ended.

        ``upto``: the page's number of the last message sent before Stop was clicked. A run numbered after it is
        not stopped: its message was sent after the click, and reached the server first (Stop then Send travel
        apart; the stopped answer may have ended meanwhile). None, or a run without a number (an API call): the
        running turn, whichever it is."""
        ticket = self.current(session)
        if ticket is None or (upto is not None and ticket.seq is not None and ticket.seq > upto):
            return False
        ticket.request_stop(reason)
        return True

    def remember(self, session: str | None, history: list[dict]) -> None:
        """Keep the session's conversation after a turn (or Clear); the oldest sessions go first."""
        if session is None:
            return
        with self._lock:
            self._keep(session, history)

    def _keep(self, session: str, history: list[dict]) -> None:
        """:meth:`remember` with the lock held: at most :data:`MAX_SESSIONS_KEPT` conversations and
        :data:`MAX_KEPT_CHARS` characters in all are kept, the least recently recorded sessions forgotten first."""
        self._conversations[session] = list(history)
        self._conversations.move_to_end(session)
        charge = _charge(history)
        self._kept_chars += charge - self._chars.get(session, 0)
        self._chars[session] = charge
        while len(self._conversations) > MAX_SESSIONS_KEPT or (
                self._kept_chars > MAX_KEPT_CHARS and len(self._conversations) > 1):
            old, _ = self._conversations.popitem(last=False)
            self._kept_chars -= self._chars.pop(old, 0)

    def kept_chars(self) -> int:
        """Characters of conversation kept over all sessions (as :data:`MAX_KEPT_CHARS` counts them)."""
        with self._lock:
            return self._kept_chars

    def conversation(self, session: str | None, sent: list[dict]) -> list[dict]:
        """The conversation a page's new turn continues: the server's record of the session whenever it has one (it
        is recorded as each turn ends, so it holds turns the page has not shown yet, and is empty after Clear),
        else what the page sent."""
        with self._lock:
            known = self._conversations.get(session) if session is not None else None
        return sent if known is None else list(known)

    def add_point(self, session: str | None, point: AnswerPoint) -> None:
        """Keep a finished answer's point for the session's trade-off figure (:func:`app.quality.answer_point`)."""
        if session is None:
            return
        with self._lock:
            points = self._points.setdefault(session, [])
            points.append(point)
            del points[:-MAX_POINTS_KEPT]
            self._points.move_to_end(session)
            while len(self._points) > MAX_SESSIONS_KEPT:
                self._points.popitem(last=False)

    def drop_points(self, session: str | None) -> None:
        """Forget the session's answer points (Clear: its answers are gone, so are their points)."""
        with self._lock:
            self._points.pop(session, None)

    def points(self, session: str | None, model_key: Sequence[str] | None = None) -> list[AnswerPoint]:
        """The session's answer points, oldest first (those of ``model_key`` only, when given)."""
        with self._lock:
            points = list(self._points.get(session, [])) if session is not None else []
        if model_key is not None:
            points = [p for p in points if tuple(p.model_key) == tuple(model_key)]
        return points

    def set_controls(self, session: str | None, choice: Any, tau: Any, k_max: Any) -> None:
        """Keep the session's latest strategy, tau and k_max controls as the page last reported them (the slider
        may move while a turn answers; the turn's last trade-off figure must mark where it is now)."""
        if session is None:
            return
        with self._lock:
            self._controls[session] = (choice, tau, k_max)
            self._controls.move_to_end(session)
            while len(self._controls) > MAX_SESSIONS_KEPT:
                self._controls.popitem(last=False)

    def controls(self, session: str | None, default: tuple) -> tuple:
        """``(choice, tau, k_max)`` last reported for ``session`` (:meth:`set_controls`), else ``default``."""
        with self._lock:
            return self._controls.get(session, default) if session is not None else default

    def _release(self, ticket: RunTicket) -> None:
        """End a run (recording its conversation first, in the same step) and start the next waiting message; or
        take a ticket that never ran out of the queue."""
        with self._lock:
            queue = self._queues.get(ticket.session, [])
            if ticket in queue:
                if queue[0] is ticket and ticket.started.is_set():
                    if ticket.stop_reason() == "cleared":
                        self._keep(ticket.session, [])
                    elif ticket._conversation is not None:
                        self._keep(ticket.session, ticket._conversation)
                queue.remove(ticket)
                if not queue:
                    del self._queues[ticket.session]
                elif not any(t.started.is_set() for t in queue) and not self._earlier_missing(ticket.session,
                                                                                              queue[0].seq):
                    queue[0].started.set()
            ticket._conversation = None
        ticket.ended.set()


def _charge(history: Sequence[dict]) -> int:
    """A conversation's charge against :data:`MAX_KEPT_CHARS`: its messages' text and :data:`MESSAGE_CHARGE` each."""
    return sum(MESSAGE_CHARGE + sum(len(v) for v in m.values() if isinstance(v, str)) for m in history)


def _before(a: RunTicket, b: RunTicket) -> bool:
    """``a`` was sent before ``b`` by the page's numbers (a message without a number keeps its arrival place)."""
    return a.seq is not None and b.seq is not None and a.seq < b.seq
