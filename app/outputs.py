"""A turn's states as the page's component updates: the panes, counters, headline, figures and status of
:data:`TURN_OUTPUTS`, in one place for the page's events and the API (:mod:`app.page`). HTML comes from
:mod:`app.render`, figures from :mod:`app.figures`.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

import gradio as gr

from . import figures, headline, pass_table, render
from .requests import choice_of
from .turn import TurnState, history_after

STD_TITLE = "Standard decoding: one token per forward pass"
#: Outputs of a turn, in this order (the /chat API returns them in this order too, as plain values).
TURN_OUTPUTS = ("message", "history", "chat_std", "chat_mtp", "stats_std", "stats_mtp", "speed", "coloured",
                "figure", "race", "table", "status", "notice", "tradeoff", "result")


def figure_caption(strategy_choice: str) -> str:
    """The legend of the animated figure's colours for a strategy."""
    def sw(colour: str) -> str:
        return f'<span class="mtp-swatch" style="background:{colour}"></span>'
    if strategy_choice == "lossless":
        body = (f"{sw(figures.DRAFT_OK)} ✓ draft accepted (equals the model's own choice) · {sw(figures.DRAFT_BAD)} "
                f"✗ draft rejected · {sw(figures.OWN)} → the model's own token, always kept (its correction, or its "
                f"next token) · {sw(figures.NEW_DRAFT)} the mask block that followed the accepted drafts: the next pass's "
                f"drafts · {sw(figures.UNUSED_BLOCK)} a mask block that did not (not used). Height: the model's "
                "confidence at that place")
    else:
        body = (f"{sw(figures.FIRST)} the first proposal, the model's next token: always kept, whatever its "
                f"confidence · {sw(figures.KEPT)} kept · {sw(figures.CUT)} accepted, then cut by a stop token or the token "
                f"limit · {sw(figures.REJECTED)} dropped"
                + (" · dashed line: tau" if strategy_choice == "ConfAdapt" else ""))
    return (f'<p class="mtp-fig-caption">Forward passes of the MTP side, one frame each (▶ Play when the answer has '
            f'ended). {body}</p>')


def figure_value(state: TurnState | None, strategy_choice: str = "ConfAdapt") -> str:
    """The pass-figure component's value (:func:`app.figures.figure_json`): the caption and the figure of the MTP
    side's passes, animated once the turn has ended (while it streams, the last pass only: re-sent at every figure
    update, each frame would cost the page's browser its drawing again)."""
    records = state.mtp.passes if state is not None else []
    strategy = state.strategy if state is not None else None
    animate = state is None or state.final
    return figures.figure_json(figures.passes_figure(records, strategy, animate), figure_caption(strategy_choice))


def mtp_title(label: str | None) -> str:
    """The MTP pane's title."""
    return f"MTP decoding: {label}" if label else "MTP decoding"


def outputs_of(**values: Any) -> tuple:
    """A tuple in :data:`TURN_OUTPUTS` order: the given values, ``gr.skip()`` for the others."""
    unknown = set(values) - set(TURN_OUTPUTS)
    assert not unknown, unknown
    return tuple(values.get(name, gr.skip()) for name in TURN_OUTPUTS)


def idle_outputs(history: list[dict], status: str = "", *, kind: str = "info", notice: str = "",
                 strategy_choice: str = "ConfAdapt") -> tuple:
    """Outputs of a page with ``history`` and no turn running (the start, Clear); the trade-off figure and the
    message box are left as they are."""
    return outputs_of(
        history=history,
        chat_std=render.pane_html(history, None, None, side="standard", title=STD_TITLE),
        chat_mtp=render.pane_html(history, None, None, side="mtp", title=mtp_title(None)),
        stats_std=render.counters_html(None, side="standard", label="standard", state="waiting"),
        stats_mtp=render.counters_html(None, side="mtp", label="MTP", state="waiting"),
        speed="", coloured=render.figure1_html([]), figure=figure_value(None, strategy_choice),
        race=figures.race_figure([]), table=pass_table.pass_table_html(None),
        status=render.status_html(status, kind=kind) if status else "", notice=notice,
        result=headline.summary(None, status=status, kind=kind),
    )


def cleared_outputs(strategy_choice: str = "ConfAdapt") -> tuple:
    """The page after Clear: an empty conversation, nothing running, the status saying so (the message box and the
    trade-off figure left as they are)."""
    return idle_outputs([], headline.CLEARED, strategy_choice=strategy_choice)


def turn_outputs(state: TurnState, *, figures_due: bool, first: bool = False, status_due: bool = False) -> tuple:
    """Component updates for a turn state (figures only when due; the status line with the first and the last
    update and when ``status_due``: its text changed; the message taken once, ``""``, which the page turns into a
    box command, :func:`box_command`; the trade-off figure is the session's, drawn by the caller)."""
    if state.phase == "cleared":
        return cleared_outputs(choice_of(state.strategy))
    final = state.final
    turn, label = state.turn, state.strategy.label
    side_state = {"running": "running", "done": "done", "stopped": "stopped", "error": "error"}[state.phase]
    std_state = "done" if state.standard_done else side_state
    mtp_state = "done" if state.mtp_done else side_state
    if final:
        history = history_after(state)
        panes = (render.pane_html(history, None, None, side="standard", title=STD_TITLE),
                 render.pane_html(history, None, None, side="mtp", title=mtp_title(label)))
    else:
        history = gr.skip()
        panes = (render.pane_html(turn.history, turn.message, state.standard.text, side="standard", title=STD_TITLE,
                                  running=not state.standard_done),
                 render.pane_html(turn.history, turn.message, state.mtp.text, side="mtp", title=mtp_title(label),
                                  running=not state.mtp_done))
    status, kind = headline.turn_status(state)
    draw = figures_due or final
    failed_early = state.phase == "error" and not state.standard.passes and not state.mtp.passes
    sp = state.speed
    return outputs_of(
        message=turn.message if failed_early else ("" if first else gr.skip()),  # a message is never lost
        history=history, chat_std=panes[0], chat_mtp=panes[1],
        stats_std=render.counters_html(state.standard, side="standard", label="standard", state=std_state,
                                       timing=sp.standard if sp else None),
        stats_mtp=render.counters_html(state.mtp, side="mtp", label=label, state=mtp_state,
                                       timing=sp.mtp if sp else None, verifies=state.strategy.lossless),
        speed=headline.speed_html(state),  # with the counters, in the same update: the headline never lags them
        coloured=render.figure1_html(state.mtp.passes, state.strategy) if draw else gr.skip(),
        figure=figure_value(state, choice_of(state.strategy)) if draw else gr.skip(),
        race=figures.race_figure([("standard", state.standard.passes), (label, state.mtp.passes)])
        if draw else gr.skip(),
        table=pass_table.pass_table_html(state) if final else gr.skip(),
        status=render.status_html(status, kind=kind) if (first or final or status_due) else gr.skip(),
        notice="" if (first or final) else gr.skip(),
        result=headline.summary(state, status=status, kind=kind) if final else gr.skip(),
    )


#: A notice's mark by its kind: something under way (a message waiting, a stop on its way), a request refused,
#: plain information. All three are in DejaVu Sans (an hourglass, U+23F3, is not: an empty box in a Chromium that has
#: only DejaVu's fonts).
NOTICE_MARKS = {"wait": "◴", "refused": "⚠", "info": "ℹ"}


def notice_html(text: str, kind: str = "wait") -> str:
    """An in-page notice under the message box (never a toast over the controls), marked by ``kind`` (a key of
    :data:`NOTICE_MARKS`, also its ``data-kind``); ``data-at`` (the time) makes a repeated notice a new one.

    Raises:
        KeyError: an unknown ``kind``."""
    return (f'<div class="mtp-notice" role="status" data-kind="{kind}" data-at="{time.time():.3f}">'
            f'{NOTICE_MARKS[kind]} {render.esc(text)}</div>')


def refused_outputs(text: str) -> tuple:
    """Only the notice changes (the message stays in the box)."""
    return outputs_of(notice=notice_html(text, "refused"), result={"phase": "refused", "status": text})


def error_outputs(text: str, *, in_notice: bool = False) -> tuple:
    """A request refused before it ran: the status line says why (in the page, no toast), or with ``in_notice``
    (a turn of the session is answering and the status line is its) the notice under the message box; the
    message stays in the box."""
    if in_notice:
        return outputs_of(notice=notice_html(text, "refused"), result={"phase": "error", "status": text})
    return outputs_of(status=render.status_html(text, kind="error"), notice="",
                      result={"phase": "error", "status": text})


def plain_outputs(updates: Iterator[tuple], initial: dict) -> tuple:
    """The last value of every output over a run of updates (``gr.skip()`` keeps the value before), starting
    from ``initial``: what an API client gets instead of Gradio's update dicts."""
    values = dict(initial)
    for out in updates:
        for name, value in zip(TURN_OUTPUTS, out):
            if isinstance(value, dict) and value.get("__type__") == "update":
                if "value" in value:
                    values[name] = value["value"]
                continue
            values[name] = value
    return tuple(values[name] for name in TURN_OUTPUTS)


def box_command(value: Any, sent: str) -> Any:
    """The page's message-box update for a turn's ``message`` output, as a command for the box's script
    (:data:`app.scripts.BOX_JS`), which never replaces a message the user typed since: ``""`` (the message was taken)
    clears the box only if it still holds ``sent``; a text (the turn could not start) is put back only into an
    empty box, else after what the box holds. Anything else (``gr.skip()``) passes through."""
    if not isinstance(value, str):
        return value
    command = {"clear": sent} if value == "" else {"restore": value}
    return json.dumps({**command, "at": time.time()})
