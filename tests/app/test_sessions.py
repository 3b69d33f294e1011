"""Sessions (app/sessions.py): one turn at a time per session, in the order the messages came; what a turn that
ends (however it ends) leaves for the next; Stop and Clear. Every step is checked in order, never against the
clock."""

from __future__ import annotations

from app.sessions import MAX_WAITING, SessionRuns

STOPPED = [{"role": "user", "content": "Tell me a story."},
           {"role": "assistant", "content": "Once upon", "mtp": "Once upon a"}]


def test_a_message_sent_while_a_turn_runs_waits_for_it_in_order():
    runs = SessionRuns()
    first = runs.enter("s1")
    assert first.started.is_set() and runs.current("s1") is first
    second = runs.enter("s1")  # sent while the first answers: it waits, it is not refused
    assert second is not None and not second.started.is_set() and runs.waiting("s1") == 1
    more = [runs.enter("s1") for _ in range(MAX_WAITING - 1)]
    assert runs.enter("s1") is None and MAX_WAITING == 2  # one more than may wait: refused (stays in the box)
    first.request_stop()
    extra = runs.enter("s1")  # ... but never right after Stop
    assert extra is not None and runs.enter("s1") is None
    for t in more + [extra]:
        t.release()  # their pages went away
    other = runs.enter("s2")
    assert other.started.is_set()  # other sessions are independent
    first.record(STOPPED)
    first.release()  # the run ends: its conversation is kept and the waiting message starts, in one step
    assert second.started.is_set() and first.ended.is_set() and runs.current("s1") is second
    assert runs.conversation("s1", []) == STOPPED
    second.release()
    other.release()
    assert runs.current("s1") is None and runs.waiting("s1") == 0


def test_stop_ends_the_running_turn_only_and_clear_wins_over_stop():
    runs = SessionRuns()
    first, waiting = runs.enter("s"), runs.enter("s")
    assert runs.request_stop("s") and first.stop_reason() == "stopped" and waiting.stop_reason() is None
    runs.request_stop("s", "cleared")
    runs.request_stop("s", "stopped")
    assert first.stop_reason() == "cleared"
    first.record(STOPPED)
    runs.remember("s", [])
    first.release()  # a cleared run keeps no conversation; the waiting message starts the new one
    assert waiting.started.is_set() and runs.conversation("s", STOPPED) == []
    waiting.release()
    assert not runs.request_stop("s") and runs.enter(None).started.is_set()


def test_a_waiting_message_that_leaves_never_blocks_the_next():
    runs = SessionRuns()
    first, waiting = runs.enter("s"), runs.enter("s")
    waiting.release()  # its page went away while it waited
    assert waiting.ended.is_set() and runs.waiting("s") == 0 and runs.current("s") is first
    third = runs.enter("s")
    first.release()
    assert third.started.is_set()
    third.release()


def test_the_page_continues_the_servers_record_and_a_call_without_a_session_its_own_history():
    runs = SessionRuns()
    runs.remember("s", STOPPED)
    other = [{"role": "user", "content": "A different chat."}, {"role": "assistant", "content": "Yes."}]
    assert runs.conversation("s", []) == STOPPED  # the page had not shown the last turn yet
    assert runs.conversation("s", other) == STOPPED  # the server's record is the session's
    assert runs.conversation(None, other) == other  # API and MCP calls: exactly the history they send
    assert runs.conversation("new", other) == other  # no record yet


def test_messages_keep_the_order_they_were_sent_in_when_their_events_arrive_reversed():
    """Two Enters 25 ms apart can reach the server the other way round: message 2 arrives first at an idle session
    and is held (message 1 is on its way); message 1 then starts first, and 2 waits behind it. A message held for
    one that was refused (an empty one: it arrived, took no place) starts at once; one held for a message that
    never arrives is started by promote."""
    from app.sessions import SessionRuns

    runs = SessionRuns()
    runs.arrive("s", 1)  # the page's first message: nothing before it
    first = runs.enter("s", 1)
    assert first.started.is_set()
    first.release()
    runs.arrive("s", 3)
    third = runs.enter("s", 3)
    assert not third.started.is_set()  # message 2 is still on its way
    runs.arrive("s", 2)
    second = runs.enter("s", 2)
    assert second.started.is_set() and not third.started.is_set()
    assert runs.current("s") is second and runs.waiting("s") == 1
    second.release()
    assert third.started.is_set()
    third.release()
    # held for a message that arrived but was refused (empty: it never entered)
    runs.arrive("s", 5)
    fifth = runs.enter("s", 5)
    assert not fifth.started.is_set()
    runs.arrive("s", 4)  # message 4 arrives but is refused before entering
    assert not fifth.started.is_set()
    runs.settle("s")
    assert fifth.started.is_set()
    fifth.release()
    # held for a message that never comes: promote starts it
    runs.arrive("s", 7)
    seventh = runs.enter("s", 7)
    assert not seventh.started.is_set()
    runs.promote("s")
    assert seventh.started.is_set()
    seventh.release()
    runs.arrive("s", 8)  # message 6 was given up: 8 does not wait for it again
    eighth = runs.enter("s", 8)
    assert eighth.started.is_set()
    eighth.release()
    # a session's very first event may be its second message: the page numbers from 1, so message 1 is on its way
    runs.arrive("u", 2)
    second = runs.enter("u", 2)
    assert not second.started.is_set()
    runs.arrive("u", 1)
    first = runs.enter("u", 1)
    assert first.started.is_set() and not second.started.is_set()
    first.release()
    assert second.started.is_set()
    second.release()
    # messages without numbers (API tools, tests) keep their arrival order
    a, b = runs.enter("t"), runs.enter("t")
    assert a.started.is_set() and not b.started.is_set()


def test_stop_ends_only_messages_sent_before_it():
    """Stop carries the page's number of the last message sent before it was clicked. Stop then Send can reach the
    server the other way round: when the stopped answer had already ended and the next message started first,
    that Stop must not end the new turn (it was sent after the click)."""
    runs = SessionRuns()
    runs.arrive("s", 1)
    first = runs.enter("s", 1)
    first.release()  # message 1's answer ended before Stop reached the server
    runs.arrive("s", 2)
    second = runs.enter("s", 2)  # message 2, sent after the click, started first
    assert not runs.request_stop("s", upto=1) and second.stop_reason() is None
    assert runs.request_stop("s", upto=2) and second.stop_reason() == "stopped"  # a Stop clicked after message 2
    second.release()
    anonymous = runs.enter("api")  # no page number (an API client): Stop applies to what runs
    assert runs.request_stop("api", upto=0) and anonymous.stop_reason() == "stopped"
    anonymous.release()
