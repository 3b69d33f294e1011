"""The page's own scripts (run in the browser; Gradio hands them an event's values): the message as it was when
Send or Enter was pressed, the number of each message sent (the server answers them in that order), the message
box's commands, Stop's message number. :mod:`app.ui` wires them to the page's events."""

from __future__ import annotations

from typing import Any

#: What the message-number box holds for a message sent again at once (:func:`seq_js`): the server ignores it.
REPEAT = "repeat"
#: The same text sent again within this many milliseconds is one message sent twice by accident (a double click
#: lands its two clicks within ~500 ms; fixing a refused message's setting and sending it again takes longer).
REPEAT_MS = 500

#: Page-level CSS that Gradio would scope under its content container (it only reaches ancestors from
#: the document's head): narrower page margins on phones.
HEAD = """<style>
@media (max-width: 640px) { .gradio-container .main.app {padding-left: 8px !important; padding-right: 8px !important} }
</style>
<script>
/* The message as it is at the moment Enter or Send is pressed. Gradio reads an event's inputs a moment later:
   typing the next message at once (two Enters 25 ms apart) sent that one twice and lost the first. */
(() => {
  const sent = window.mtpSent = [];
  const take = () => {
    const box = document.querySelector('#message textarea');
    if (box) sent.push({text: box.value, at: performance.now()});
  };
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing && e.target.closest && e.target.closest('#message')) take();
  }, true);
  document.addEventListener('click', (e) => {
    if (e.target.closest && e.target.closest('#send')) take();
  }, true);
})();
</script>"""


#: The message box's script for the turn's box commands (:func:`app.outputs.box_command`): a message the user
#: typed since the one sent is never replaced.
BOX_JS = """(command, current) => {
  if (!command) return current;
  let c; try { c = JSON.parse(command); } catch (e) { return current; }
  if (c.clear !== undefined) return current === c.clear ? "" : current;
  if (c.restore !== undefined) {
    if (!current || !current.trim() || current === c.restore) return c.restore;
    return current.includes(c.restore) ? current : current + "\\n" + c.restore;
  }
  return current;
}"""


def seq_js(n_inputs: int) -> str:
    """Before each Send / Enter is handed to the server: the message as it was when the key or button was pressed
    (:data:`HEAD`'s script keeps it; entries older than 2 s are stale), and its number (1, 2, ... per page) in the
    hidden last of its ``n_inputs`` inputs, so that the server answers messages in the order they were sent even
    when their events arrive the other way round. The same text sent again within :data:`REPEAT_MS` (a double
    click on Send, a key bounce) gets no number: its number box holds :data:`REPEAT`, which the server ignores.
    Both times are when the key or button was pressed, a stale entry's too (its text is not used): a page busy
    for seconds, as while it loads, can run the second click's script seconds after the first's, and a double
    click timed by when the scripts ran was answered twice.
    (Gradio hands the script the inputs' values, then the outputs'; what it returns replaces the inputs.)"""
    return (f"(...args) => {{ const inputs = args.slice(0, {n_inputs}); const sent = window.mtpSent || []; "
            "let stale = null; while (sent.length && performance.now() - sent[0].at > 2000) stale = sent.shift(); "
            "const at = sent.length ? sent[0].at : (stale ? stale.at : performance.now()); "
            "if (sent.length) inputs[0] = sent.shift().text; "
            "const last = window.mtpLastSent; "
            f"if (last && inputs[0] && inputs[0].trim() && inputs[0] === last.text && at - last.at < {REPEAT_MS}) "
            f"{{ inputs[{n_inputs - 1}] = '{REPEAT}'; return inputs; }} "
            "window.mtpLastSent = {text: inputs[0], at: at}; "
            "window.mtpMessageNumber = (window.mtpMessageNumber || 0) + 1; "
            f"inputs[{n_inputs - 1}] = String(window.mtpMessageNumber); return inputs; }}")


#: Stop's script: the number of the last message sent (:func:`seq_js`), so that a Stop overtaken by the next Send
#: spares that turn (:meth:`app.sessions.SessionRuns.request_stop`).
STOP_JS = "(seq) => String(window.mtpMessageNumber || 0)"


#: After Load model: its outcome (under the button) scrolled to the middle of the window; the button is often at
#: the bottom of the window when clicked. Not 'nearest': the message can still grow by a line after the scroll
#: (Gradio renders it asynchronously), which left its last line a fraction of a pixel below the window.
SHOW_LOAD_STATUS_JS = ("() => { const e = document.querySelector('#load-status'); "
                       "if (e) e.scrollIntoView({block: 'center'}); }")


def message_number(value: Any) -> int | None:
    """The page's number for a message from its hidden box (:func:`seq_js`; None when absent or not a number, as
    for :data:`REPEAT` or an API call)."""
    try:
        return int(float(value)) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None
