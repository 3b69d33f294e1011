"""The per-pass table of a turn (both sides, every forward pass) and the words for why a block ended, which the
pass figure's titles share (:mod:`app.figures`). HTML as :mod:`app.render` draws it: every text escaped."""

from __future__ import annotations

from .render import esc
from .turn import TurnState

#: Short forms of ``PassRecord.block_end`` for the table (the cell's tooltip: :data:`BLOCK_END_WORDS`).
BLOCK_END_SHORT = {"k_max": "k_max", "below tau": "< tau", "utf-8": "utf-8", "draft rejected": "rejected",
                   "stop token": "stop", "stop string": "stop str", "max_new_tokens": "max new"}
#: ``PassRecord.block_end`` in words: why a pass kept no more (the table's tooltips, the pass figure's titles).
BLOCK_END_WORDS = {"k_max": "every proposal kept", "below tau": "the next proposal was below tau",
                   "utf-8": "the next proposal would split a character", "draft rejected": "a draft was rejected",
                   "stop token": "a stop token", "stop string": "a stop string",
                   "max_new_tokens": "max new tokens reached"}


def _one_line(text: str) -> str:
    """A pass's text on one line: newlines and tabs as marks (CSS), the rest literal."""
    return (esc(text).replace("\n", '<span class="mtp-nl" aria-hidden="true"></span>')
            .replace("\t", '<span class="mtp-tab" aria-hidden="true"></span>'))


def pass_table_html(state: TurnState | None) -> str:
    """Every forward pass of both sides: tokens fed (real + masks, or real + drafts + masks), kept,
    why the block ended, ms (``41×3``: a pass shared by 3 sessions, its rows in the cell's title), text. Narrow
    enough for a phone; numbers never wrap."""
    if state is None or not (state.standard.passes or state.mtp.passes):
        return '<div class="mtp-table-empty">No passes yet.</div>'
    rows = []
    for side, res in (("std", state.standard), ("MTP", state.mtp)):
        for r in res.passes:
            fed = f"{r.fed_real}+{r.fed_drafts}+{r.fed_masks}" if r.fed_drafts else f"{r.fed_real}+{r.fed_masks}"
            end = BLOCK_END_SHORT.get(r.block_end, r.block_end)
            shared = (f' title="shared by {r.shared_sequences} sessions, {r.shared_rows} rows">'
                      f"{1000 * r.seconds:.0f}×{r.shared_sequences}" if r.shared_sequences > 1 else
                      f">{1000 * r.seconds:.0f}")
            rows.append(f"<tr><td>{side}</td><td>{r.index + 1}</td><td>{fed}</td><td>{len(r.kept)}</td>"
                        f'<td title="{esc(BLOCK_END_WORDS.get(r.block_end, r.block_end))}">{esc(end)}</td><td{shared}</td>'
                        f'<td class="mtp-td-text" dir="auto" title="{esc(r.text)}">{_one_line(r.text)}</td></tr>')
    head = ('<tr><th title="std = standard decoding, MTP = the right pane">side</th><th>pass</th>'
            '<th title="tokens fed: real + masks (real + drafts + masks when verifying)">fed</th>'
            '<th title="tokens this pass added to the answer">kept</th>'
            '<th title="why the block ended">end</th><th title="milliseconds of this forward pass (×n: shared by n sessions)">ms</th>'
            "<th>text</th></tr>")
    return (f'<div class="mtp-table-wrap"><table class="mtp-table"><thead>{head}</thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')
