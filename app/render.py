"""HTML fragments of the page, drawn from turn states and engine records (no Gradio, no model code).

Every text from the user or the model is escaped here and shown literally: HTML stays text,
whitespace and indentation are kept (``white-space: pre-wrap``), fenced code blocks are
preformatted, and each block of text gets ``dir="auto"`` so right-to-left scripts lay out as they
should. Texts come from the engine's records (``PassRecord.text``, ``GenerationResult.text``),
which never end in an incomplete character; nothing here decodes tokens.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any, Sequence

from model.engine.loaded_model import LoadedModel
from model.engine.decoding import GenerationResult, PassRecord
from model.engine.strategies import Strategy

from .device import LosslessShape, WidthProfile
from .timing import MIN_PAIRS_FOR_INTERVAL, SideTiming, SpeedEstimate, side_timing
from .turn import TurnState

# ---------------------------------------------------------------------------- text
#: A fence line (```lang), with the line break before it and its own: those belong to the fence, so
#: the text before it and the code block carry no stray blank line.
_FENCE = re.compile(r"\n?^[ \t]*```[^\n]*\n?", re.M)


def esc(text: Any) -> str:
    """HTML-escaped text (quotes too)."""
    return html.escape("" if text is None else str(text), quote=True)


def _text(text: str) -> str:
    return f'<span class="mtp-text">{esc(text)}</span>' if text else ""


def message_html(text: str) -> str:
    """One message shown literally: text with its whitespace, fenced code blocks as ``<pre>``.

    An opening fence without its closing fence (an answer still streaming, or cut by max new
    tokens) runs to the end of the text.
    """
    out, pos, in_code = [], 0, False
    for m in _FENCE.finditer(text):
        chunk = text[pos:m.start()]
        if in_code:
            out.append(f'<pre class="mtp-code"><code>{esc(chunk)}</code></pre>')
        else:
            out.append(_text(chunk))
        out.append(f'<span class="mtp-fence">{esc(m.group(0))}</span>')
        in_code, pos = not in_code, m.end()
    rest = text[pos:]
    if in_code:
        out.append(f'<pre class="mtp-code"><code>{esc(rest)}</code></pre>')
    else:
        out.append(_text(rest))
    return "".join(out)


def pane_html(history: Sequence[dict], message: str | None, answer: str | None, *, side: str, title: str,
              running: bool = False) -> str:
    """A chat pane: the conversation so far, then this turn's message and (streaming) answer.

    Args:
        history: :func:`app.requests.parse_history` messages; the MTP pane shows assistant messages'
            ``"mtp"`` text where present.
        message: this turn's user message (None: no turn in progress).
        answer: this turn's answer so far.
        side: ``"standard"`` or ``"mtp"``.
        title: the pane's heading (shown above the scroll area, never over the text).
        running: show a cursor after the answer.
    """
    rows = []
    for m in history:
        content = m.get("mtp", m["content"]) if side == "mtp" and m["role"] == "assistant" else m["content"]
        rows.append(_bubble(m["role"], content))
        if side == "mtp" and m["role"] == "assistant" and "mtp" in m and m["mtp"] != m["content"]:
            rows.append('<div class="mtp-note">The conversation continues from the standard answer (left), '
                        "so both panes answer the same prompts.</div>")
    if message is not None:
        rows.append(_bubble("user", message))
        rows.append(_bubble("assistant", answer or "", cursor=running))
    body = "".join(rows) or '<div class="mtp-empty">No messages yet.</div>'
    return (f'<section class="mtp-pane" data-side="{side}" aria-label="{esc(title)}">'
            f'<header class="mtp-pane-title">{esc(title)}</header>'
            f'<div class="mtp-scroll" role="log"><div class="mtp-msgs">{body}</div></div></section>')


def _bubble(role: str, text: str, cursor: bool = False) -> str:
    who = "user" if role == "user" else ("system" if role == "system" else "bot")
    tail = '<span class="mtp-cursor" aria-hidden="true">▍</span>' if cursor else ""
    return (f'<div class="mtp-msg mtp-{who}" data-role="{who}" dir="auto">'
            f'<div class="mtp-msg-text">{message_html(text)}</div>{tail}</div>')


# ---------------------------------------------------------------------------- counters
#: Counter name -> what it means (the page shows these as tooltips and in a caption). The timing counters
#: follow the page's one timing method (:data:`TIMING_HELP`); "measured s" is the other measure, named so.
COUNTER_HELP = {
    "tokens": "tokens generated so far",
    "passes": "forward passes of the model (the first one reads the whole prompt)",
    "eff. k": "effective k: tokens per forward pass (vLLM and llama.cpp call it the mean acceptance length)",
    "prefill ms": "the first forward pass: the prompt (plus masks on the MTP side)",
    "ms/pass": ("this side's typical later pass: for standard decoding the median of all its passes, for MTP that "
                "median × the "
                "median ratio of paired passes (How speed is measured)"),
    "time s": "prefill + (passes − 1) × ms/pass: this side's time by the page's one timing method",
    "tok/s": "tokens ÷ time s; the headline is the MTP side's tok/s ÷ the standard side's",
    "measured s": ("a different measure: the plain sum of this side's own pass times, load spikes included "
                   "(the race chart)"),
}
#: Lossless verification's acceptance counters, named as vLLM and llama.cpp name them.
VERIFY_COUNTER_HELP = {
    "acc. rate": "draft acceptance rate (vLLM, llama.cpp): drafts accepted ÷ drafts checked",
    "by position": ("acceptance by draft position (vLLM's per-position acceptance rate): the share of passes that "
                    "accepted draft 1, 2, 3, … (a draft after a rejected one counts as rejected)"),
}


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None or not math.isfinite(x) else format(x, fmt)


def counters(result: GenerationResult | None, timing: SideTiming | None = None, *, verifies: bool = False
             ) -> dict[str, str]:
    """The counters of one side as display strings, keyed as :data:`COUNTER_HELP` (and
    :data:`VERIFY_COUNTER_HELP` when ``verifies``).

    Args:
        result: the side's generation so far.
        timing: the side's :class:`app.timing.SideTiming` from the turn's speed estimate (None: the method
            applied to this side alone, its own median pass).
    """
    keys = list(COUNTER_HELP) + (list(VERIFY_COUNTER_HELP) if verifies else [])
    if result is None or not result.passes:
        return {k: "–" for k in keys}
    t = timing or side_timing(result.passes)
    out = {
        "tokens": f"{result.new_tokens}",
        "passes": f"{result.forward_passes}",
        "eff. k": f"{result.effective_k:.2f}",
        "prefill ms": f"{1000 * t.prefill:.0f}",
        "ms/pass": _num(None if t.per_pass is None else 1000 * t.per_pass, ".0f"),
        "time s": f"{t.seconds:.2f}",
        "tok/s": f"{t.tokens_per_second:.1f}",
        "measured s": f"{t.measured:.2f}",
    }
    if verifies:
        out["acc. rate"] = _num(result.draft_acceptance_rate, ".2f")
        by_pos = result.acceptance_by_position
        out["by position"] = " / ".join(_num(a, ".2f") for a in by_pos) if by_pos else "–"
    return out


def counters_html(result: GenerationResult | None, *, side: str, label: str, state: str,
                  timing: SideTiming | None = None, verifies: bool = False) -> str:
    """The counters under a pane: a wrapping row of label / value cells (never wrapped inside).

    Args:
        state: ``waiting``, ``running``, ``done``, ``stopped``, ``cleared`` or ``error``.
        timing, verifies: see :func:`counters`.
    """
    helps = {**COUNTER_HELP, **VERIFY_COUNTER_HELP}
    cells = "".join(
        f'<div class="mtp-counter" data-name="{esc(k)}" title="{esc(helps[k])}">'
        f'<span class="mtp-counter-name">{esc(k)}</span><span class="mtp-counter-value">{esc(v)}</span></div>'
        for k, v in counters(result, timing, verifies=verifies).items())
    state_text = {"running": "running…", "waiting": "waiting"}.get(state, state)
    return (f'<div class="mtp-counters" data-side="{side}" data-state="{esc(state)}">'
            f'<div class="mtp-counters-head"><b>{esc(label)}</b> · <span class="mtp-state">{esc(state_text)}</span>'
            f'</div><div class="mtp-counter-row">{cells}</div></div>')


def counters_caption() -> str:
    """One line that explains the counters (also their tooltips)."""
    parts = "; ".join(f"<b>{esc(k)}</b>: {esc(v)}" for k, v in {**COUNTER_HELP, **VERIFY_COUNTER_HELP}.items())
    return f'<details class="mtp-caption"><summary>What the counters mean</summary><p>{parts}.</p></details>'


#: The page's one timing method, said once ("How speed is measured").
TIMING_HELP = (
    "Every forward pass is timed alone: passes of all sessions run one at a time, device synchronised, and the "
    "two sides alternate pass by pass (ABBA), so neither always runs first. A side's <b>time</b> is its first "
    "pass (the prompt) plus its other passes at its typical pass: the median of all the standard side's passes, "
    "and for MTP that median × the median ratio of paired passes (pass i of each side ran back to back, so load hits both "
    "alike). <b>tok/s</b> = tokens ÷ time, and the <b>headline</b> is the MTP side's tok/s ÷ the standard side's, "
    "with a 90% interval from resampling the passes (none from fewer than 5 pairs). The counters' prefill ms, ms/pass, time s and tok/s are "
    "these figures. Different measures, labelled as such: <b>measured s</b>, the <b>race chart</b> and the "
    "headline's \u201cmeasured sums\u201d are the plain sums of each side's own pass times (a load spike on one "
    "side shows there, not in the headline); the per-pass table lists each pass's own time; the status line's "
    "wall-clock seconds count both sides, the rendering and the two scoring passes.")


def timing_html() -> str:
    """The "How speed is measured" text (shown once, under the headline)."""
    return (f'<details class="mtp-caption mtp-timing"><summary>How speed is measured</summary>'
            f"<p>{TIMING_HELP}</p></details>")


# ---------------------------------------------------------------------------- speed
def times_text(ratio: float) -> str:
    """``1.32× faster``, ``2.80× slower`` or ``1.00× (the same speed)``."""
    if not math.isfinite(ratio) or ratio <= 0:
        return "unknown"
    if round(ratio, 2) == 1.0:
        return "1.00× (the same speed)"
    return f"{ratio:.2f}× faster" if ratio > 1 else f"{1 / ratio:.2f}× slower"


def _interval_text(low: float, high: float) -> str:
    def one(r: float) -> str:
        return f"{r:.2f}× faster" if r >= 1 else f"{1 / r:.2f}× slower"
    return f"{one(low)} to {one(high)}"


#: NLL differences (nats per token) smaller than this read as "equally likely".
NLL_TIE = 0.005


def headline(state: TurnState) -> tuple[str, bool]:
    """The speed and its cost in one sentence, and whether it is a warning.

    A warning whenever the MTP answer parts from standard decoding's and is less likely under the model,
    or degenerates into repetition: such an answer never reads as a plain win. Before both sides are
    scored the sentence says how the answers agree so far.

    Returns:
        ``(sentence, warn)``, e.g. ``("ConfAdapt tau=0.90 k_max=4: 1.32× faster, identical answer.", False)``.
    """
    label, sp = state.strategy.label, state.speed
    if sp is None:
        return f"{label} vs standard decoding: waiting for both sides’ first tokens…", False
    speed = times_text(sp.ratio) + _against_the_sums(sp)
    q, parted, warn = state.quality, state.parted_at, False
    if state.identical and state.final:
        cost = "identical answer" + (" (lossless)" if state.strategy.verifies else "")
    elif parted is None:
        n = min(len(state.standard.token_ids), len(state.mtp.token_ids))
        cost = f"identical so far (the first {n} tokens)"
    elif q is None or q.gap is None:
        cost = f"the answer parts at token {parted + 1}" + ("" if state.final else " (quality once both are done)")
    elif q.gap > NLL_TIE:
        cost = (f"but the answer parts at token {parted + 1} and is {q.gap:.2f} nats/token less likely under the "
                f"model ({q.mtp_nll:.2f} vs {q.standard_nll:.2f})")
        warn = True
    elif q.gap < -NLL_TIE:
        cost = (f"the answer parts at token {parted + 1} and is {-q.gap:.2f} nats/token more likely under the model "
                f"({q.mtp_nll:.2f} vs {q.standard_nll:.2f})")
    else:
        cost = (f"the answer parts at token {parted + 1}, equally likely under the model ({q.mtp_nll:.2f} vs "
                f"{q.standard_nll:.2f})")
    if q is not None and q.mtp_repeats:
        warn = True
        if q.standard_repeats:
            cost += ", and both answers degenerate into repetition"
        else:  # one "but" per sentence
            cost += ", and it degenerates into repetition" if cost.startswith("but ") else \
                ", but its answer degenerates into repetition"
    elif q is not None and q.standard_repeats:
        cost += ", though standard decoding's answer degenerates into repetition"
    return f"{label}: {speed}, {cost}.", warn


def direction(ratio: float) -> int:
    """1 faster, -1 slower, 0 the same speed (as :func:`times_text` words it, to two decimals)."""
    if not math.isfinite(ratio) or ratio <= 0 or round(ratio, 2) == 1.0:
        return 0
    return 1 if ratio > 1 else -1


def pairs_text(n: int) -> str:
    """``1 pair of passes`` / ``3 pairs of passes``."""
    return f"{n} pair{'' if n == 1 else 's'} of passes"


def _against_the_sums(sp: SpeedEstimate) -> str:
    """Where the headline's ratio and the measured sums point different ways (one faster, the other slower), a
    parenthesis that says so and why; else nothing."""
    if direction(sp.ratio) * direction(sp.raw_ratio) >= 0:
        return ""
    if sp.low is None or sp.high is None:
        why = f"{pairs_text(sp.pairs)} {'is' if sp.pairs == 1 else 'are'} too few to tell"
    elif sp.low <= 1.0 <= sp.high:
        why = "its 90% interval includes equal speed"
    else:
        why = "load on one side skews the sums; the typical pass discounts it"
    return f" (the measured sums read {times_text(sp.raw_ratio)}: {why})"


def speed_html(state: TurnState | None) -> str:
    """The headline (:func:`headline`, styled as a warning when it is one), then the details: what the ratio
    measures, its uncertainty, effective k and the cost of one pass, the plain sums, how the answers agree
    and each answer's likelihood under the model."""
    if state is None:
        return ""
    sp: SpeedEstimate | None = state.speed
    sentence, warn = headline(state)
    if sp is None:
        return f'<div class="mtp-speed" data-warn="0"><b>{esc(sentence)}</b></div>'
    what = "wall-clock speed" if sp.same_length else "speed in tokens per second (the answers differ in length)"
    bits = [f"{what}"]
    if sp.low is not None and sp.high is not None:
        bits.append(f"90% interval {_interval_text(sp.low, sp.high)} over {sp.pairs} alternating pairs of passes")
        if sp.low <= 1.0 <= sp.high and round(sp.ratio, 2) != 1.0:
            bits.append("the interval includes equal speed: no clear difference")
    else:
        bits.append(f"no interval from {pairs_text(sp.pairs)} (it needs {MIN_PAIRS_FOR_INTERVAL})")
    k = state.mtp.effective_k
    if sp.pass_cost is not None:
        bits.append(f"effective k {k:.2f} tokens per pass, and one MTP pass costs {sp.pass_cost:.2f}× a standard "
                    "pass (medians)")
    else:
        bits.append(f"effective k {k:.2f}")
    bits.append(f"measured sums (race chart; load spikes skew them): {times_text(sp.raw_ratio)}")
    verifies = state.turn.strategy.verifies
    parted = state.parted_at
    if state.identical:
        agree = "identical answers: lossless, as it must be" if verifies else "identical answers"
    elif parted is None:
        n = min(len(state.standard.token_ids), len(state.mtp.token_ids))
        agree = f"identical so far: the first {n} tokens agree and one side is further ahead"
    else:
        agree = _parting(state, parted) if verifies else "the answers differ"
    bits.append(agree)
    q = state.quality
    if q is not None and (q.standard_nll is not None or q.mtp_nll is not None):
        bits.append(f"negative log-likelihood per token under the model (adapter off; one scoring pass per answer, "
                    f"not timed): standard {_num(q.standard_nll, '.2f')}, MTP {_num(q.mtp_nll, '.2f')}")
    pace = {1: "faster", -1: "slower", 0: "same"}[direction(sp.ratio)]
    cls = "mtp-speed mtp-warn" if warn else f"mtp-speed mtp-{pace}"  # a slowdown never looks like a success
    mark = '<span class="mtp-warn-mark" aria-hidden="true">⚠️ </span>' if warn else ""
    role = ' role="alert"' if warn and state.final else ""
    return (f'<div class="{cls}" data-ratio="{sp.ratio:.4f}" data-warn="{int(warn)}" data-pace="{pace}"{role}>'
            f'<div class="mtp-headline">{mark}<b>{esc(sentence)}</b></div>'
            f'<div class="mtp-speed-details">{"; ".join(esc(b) for b in bits)}.</div></div>')


def _parting(state: TurnState, i: int) -> str:
    """Why a lossless answer differs from standard decoding's at token position ``i`` (0-based, where they
    part): how close the call was there, and why a wide pass can decide it differently."""
    conf = state.standard.passes[i].confidences[0] if i < len(state.standard.passes) else None
    close = f" (standard decoding's top candidate there had probability {conf:.2f})" if conf is not None else ""
    dt = dtype_name(state.turn.lm) or "this precision"
    return (f"the answers part at token {i + 1}{close}: in {dt} a pass over several tokens rounds differently from a "
            "one-token pass, and there the two best candidates were nearly tied; in float32 they are identical")


# ---------------------------------------------------------------------------- the paper's Figure 1
#: Background colours for blocks of 2, 3, 4, ... tokens (the last repeats); all light enough for
#: dark text at a contrast of at least 7:1. A pass of one token (what standard decoding does) stays
#: plain text, so the answer reads as text and the multi-token blocks stand out.
KEPT_COLOURS = ("#cfe3f7", "#c9efc4", "#fff2a8", "#ffd9a8", "#ffc2c2", "#e8c9f5", "#c2f0ec")
TEXT_ON_COLOUR = "#111111"


def kept_colour(kept: int) -> str | None:
    """Background colour of a pass that kept ``kept`` tokens (None for one token: plain text)."""
    return None if kept <= 1 else KEPT_COLOURS[min(kept - 1, len(KEPT_COLOURS)) - 1]


def _kept_style(kept: int) -> str:
    colour = kept_colour(kept)
    return f' style="background:{colour};color:{TEXT_ON_COLOUR}"' if colour else ""


def _pass_title(rec: PassRecord, strategy: Strategy | None) -> str:
    n = len(rec.kept)
    head = f"forward pass {rec.index + 1}: {n} token{'s' if n != 1 else ''}"
    if strategy is not None and strategy.verifies:
        if rec.fed_drafts:
            head += f"; {min(rec.drafts_accepted, n)} of {rec.fed_drafts} drafts accepted"
            head += ", then the model's correction" if rec.correction is not None else ", then the model's next token"
        else:
            head += " (no drafts to check)"
    else:
        confs = ", ".join(f"{c:.2f}" for c in rec.confidences[:n])
        head += f"; confidences {confs}"
    return f"{head}; block ended: {rec.block_end}"


def figure1_html(records: Sequence[PassRecord], strategy: Strategy | None = None) -> str:
    """The MTP answer as running text, one coloured span per forward pass (the paper's Figure 1).

    Colour = tokens the pass kept; hovering a span gives the pass number, the tokens it kept,
    the confidences (or, when verifying, the drafts accepted) and why the block ended. Newlines
    are shown as ``↵`` marks (CSS, not text) so that a pass that emitted only a newline stays
    visible. Passes of one token stay plain text; a legend lists the counts that occur.
    """
    spans, counts = [], set()
    for r in records:
        if not r.text:
            continue
        w = len(r.kept)
        counts.add(w)
        body = esc(r.text).replace("\n", '<span class="mtp-nl" aria-hidden="true"></span>\n')
        spans.append(f'<span class="mtp-blk{" mtp-multi" if w > 1 else ""}" data-pass="{r.index + 1}" '
                     f'data-kept="{w}"{_kept_style(w)} title="{esc(_pass_title(r, strategy))}">{body}</span>')
    if not spans:
        return ('<div class="mtp-fig1-wrap"><div class="mtp-fig1-empty">The MTP answer, coloured by forward '
                "pass, appears here.</div></div>")
    legend = "".join(f'<span class="mtp-legend-item"{_kept_style(w)}>{w}</span>' for w in sorted(counts))
    return ('<div class="mtp-fig1-wrap"><div class="mtp-legend"><span>tokens per forward pass:</span> '
            f'{legend}<span class="mtp-legend-hint">(hover a span for its pass)</span></div>'
            f'<div class="mtp-fig1" dir="auto">{"".join(spans)}</div></div>')


# ---------------------------------------------------------------------------- the per-pass table
#: Short forms of ``PassRecord.block_end`` for the table (the full reason is the cell's tooltip).
BLOCK_END_SHORT = {"k_max": "k_max", "below tau": "< tau", "utf-8": "utf-8", "draft rejected": "rejected",
                   "stop token": "stop", "max_new_tokens": "max new"}


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
                        f'<td title="{esc(r.block_end)}">{esc(end)}</td><td{shared}</td>'
                        f'<td class="mtp-td-text" dir="auto" title="{esc(r.text)}">{_one_line(r.text)}</td></tr>')
    head = ('<tr><th title="std = standard decoding, MTP = the right pane">side</th><th>pass</th>'
            '<th title="tokens fed: real + masks (real + drafts + masks when verifying)">fed</th>'
            '<th title="tokens this pass added to the answer">kept</th>'
            '<th title="why the block ended">end</th><th title="milliseconds of this forward pass (×n: shared by n sessions)">ms</th>'
            "<th>text</th></tr>")
    return (f'<div class="mtp-table-wrap"><table class="mtp-table"><thead>{head}</thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


# ---------------------------------------------------------------------------- model and strategy
def dtype_name(lm: LoadedModel) -> str | None:
    """``bf16`` / ``fp32`` / ... when the engine says which dtype runs (``lm.dtype``), else None."""
    dt = getattr(lm, "dtype", None)
    if dt is None:
        return None
    name = str(dt).replace("torch.", "")
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float64": "fp64"}.get(name, name)


def model_html(lm: LoadedModel, quantization: str = "none") -> str:
    """What is loaded: source, device, dtype and forward path (when the engine says), quantization,
    MTP-trained or not, adapter, warnings."""
    trained = "MTP-trained" if lm.mtp_trained else "<b>not MTP-trained</b> (the mask token is new: proposals are poor)"
    bits = [f"<b>Model</b> <code>{esc(lm.source)}</code>", esc(str(lm.device))]
    dt = dtype_name(lm)
    if dt:
        bits.append(esc(dt))
    path = getattr(lm, "forward_path", None)
    if path:
        bits.append(esc(path))
    if quantization != "none":
        bits.append(f"quantization {esc(quantization)}")
    bits.append(trained)
    if lm.adapter:
        bits.append(f"adapter {esc(lm.adapter)}")
    if lm.trained_k_max:
        bits.append(f"trained with k_max {lm.trained_k_max}")
    bits.append(f"mask token id {lm.mask_token_id}")
    bits.append(f"prompt format {esc(lm.prompt_format)}")
    lines = [" · ".join(bits)] + [f"⚠️ {esc(w)}" for w in lm.warnings]
    return '<div class="mtp-model">' + "<br>".join(lines) + "</div>"


#: One line per strategy of the right pane (the page shows the chosen one).
STRATEGY_HELP = {
    "ConfAdapt": ("<b>ConfAdapt</b>: each forward pass proposes up to k_max tokens; it keeps the first proposal "
                  "(the model's ordinary next token) always, then the following ones while their confidence is at "
                  "least tau."),
    "static k": "<b>static k</b>: each forward pass keeps exactly its first k proposals, whatever their confidence.",
    "lossless": ("<b>lossless</b> (self-speculative verification): each pass feeds the previous pass's mask "
                 "proposals as drafts, keeps the drafts equal to the model's own greedy choice, plus its next token. "
                 "<b>Its answer is standard decoding's</b>; only the number of forward passes changes. Exactly so in "
                 "float32; in bf16 a pass over several tokens rounds differently from a one-token pass, so where two "
                 "candidates are nearly tied the answers can part (the page says where; Model › Precision › float32 "
                 "makes them identical to the bit)."),
}


def strategy_help_html(choice: str, shape_line: str = "") -> str:
    """The explanation line for the chosen strategy (for lossless, then the shape line: :func:`shape_text`)."""
    extra = f'<div class="mtp-shape">{esc(shape_line)}</div>' if shape_line and choice == "lossless" else ""
    return f'<div class="mtp-strategy-help">{STRATEGY_HELP.get(choice, "")}{extra}</div>'


def width_text(profile: WidthProfile, width: int = 4, *, where: bool = True) -> str:
    """``a pass of 4 tokens costs 1.80× a pass of 1 here (float32, cpu)`` (without the place when not ``where``)."""
    text = f"a pass of {width} tokens costs {profile.ratio(width):.2f}× a pass of 1"
    return f"{text} here ({profile.dtype}, {profile.device})" if where else text


def _acceptance_text(shape: LosslessShape) -> str:
    acc = " / ".join(f"{a:.2f}" for a in shape.acceptance[:4]) + (" / …" if len(shape.acceptance) > 4 else "")
    return f"acceptance by draft position {acc}, {shape.source}"


def shape_text(shape: LosslessShape | None, profile: WidthProfile | None, shape_choice: str = "fastest here",
               k_max: Any = None, error: str | None = None) -> str:
    """Which shape lossless turns run, and why, in one line.

    Args:
        shape: the fastest shape within the k_max box (:meth:`app.device.ModelFacts.shape`), or None.
        profile: the device's width profile (None: not measured yet).
        shape_choice: the page's shape control (``fastest here``, ``linear``, ``full tree``).
        k_max: the k_max box (the limit).
        error: why the width profile could not be measured.
    """
    if shape_choice != "fastest here":
        return (f"Shape: {shape_choice} at k_max {k_max if k_max is not None else 'as set'}, as chosen (\u201cfastest "
                "here\u201d fits it to this device).")
    if shape is None or profile is None:
        why = f"the width cost could not be measured ({error})" if error else "the width cost is not measured yet"
        return f"Shape: linear at the k_max box, because {why}."
    gain = ("no draft pays for its width here, so lossless runs as standard decoding" if shape.k_max <= 1
            else f"expected {shape.speedup:.2f}× standard decoding's speed here")
    return (f"Shape: {shape.describe()} (k_max box {shape.limit} is the upper bound): {gain}, from this device's "
            f"width cost ({width_text(profile)}) and the {_acceptance_text(shape)}.")


def device_note_html(profile: WidthProfile | None, shape: LosslessShape | None) -> str:
    """Before the first answer, on a CPU without native bf16: why MTP cannot be fast here, the measured width
    cost, and the fastest lossless setting (the page's button applies it). Empty elsewhere."""
    if profile is None or not profile.slow_width:
        return ""
    best = ("standard decoding itself (k_max 1): no draft pays for its width here" if shape is None or shape.k_max <= 1
            else f"{shape.describe()}, expected {shape.speedup:.2f}× standard decoding's speed")
    return ('<div class="mtp-device-note" role="note"><b>MTP cannot be fast on this device:</b> '
            f"{esc(width_text(profile))}. MTP gains only where a pass over several tokens costs about what a "
            "one-token pass costs (a GPU, or a CPU with native bf16); this CPU has no native bf16, so expect the "
            f"MTP side to run slower than standard decoding. Fastest lossless setting here: {esc(best)}.</div>")


def status_html(text: str, *, kind: str = "info") -> str:
    """The status line (``kind``: info, error)."""
    if kind == "error":
        return f'<div class="mtp-status mtp-error" role="alert">⚠️ <b>Error:</b> {esc(text)}</div>'
    return f'<div class="mtp-status">{esc(text)}</div>'


def turn_status(state: TurnState) -> tuple[str, str]:
    """(text, kind) of the status line for a turn's state."""
    n, label, src = state.turn.number, state.strategy.label, state.turn.lm.source
    if state.phase == "running":
        return f"Turn {n}: running standard vs {label} on {src}…", "info"
    if state.phase == "done":
        return (f"Turn {n}: done in {state.wall_seconds:.1f} s wall-clock (both sides, passes alternating, and one "
                "scoring pass per answer).", "info")
    if state.phase == "stopped":
        return (f"⏹ Turn {n}: stopped after {state.standard.new_tokens} standard and {state.mtp.new_tokens} MTP "
                "tokens. The partial answers stay in the conversation; send a new message to continue.", "info")
    if state.phase == "cleared":
        return "Cleared: a new conversation starts with your next message.", "info"
    return f"Turn {n} failed: {state.error}", "error"


def summary(state: TurnState | None, *, status: str = "", kind: str = "info") -> dict:
    """A plain, strict-JSON summary of a turn for API clients: texts, counters, speed (``speed.ratio`` is the
    headline's; each side's ``timing`` holds the page's one timing method, its ``seconds`` and
    ``tokens_per_second`` the plain sums), ``headline`` and ``warning``, the first token where the answers
    part (``parted_at``, 0-based, None when they do not), each answer's ``quality`` (mean NLL per token
    under the model, repetition), lossless acceptance figures and the chosen ``shape``, and the state."""
    if state is None:
        return {"phase": "error" if kind == "error" else "idle", "status": status}

    def side(res: GenerationResult, strategy: str) -> dict:
        return {"strategy": strategy, "text": res.text, "new_tokens": res.new_tokens,
                "forward_passes": res.forward_passes, "effective_k": round(res.effective_k, 4),
                "seconds": round(res.seconds, 6), "tokens_per_second": round(res.tokens_per_second, 3),
                "pass_seconds": [round(p.seconds, 6) for p in res.passes],
                "kept_per_pass": [len(p.kept) for p in res.passes]}

    sp = state.speed
    speed = None if sp is None else {
        "ratio": round(sp.ratio, 4), "low": None if sp.low is None else round(sp.low, 4),
        "high": None if sp.high is None else round(sp.high, 4), "pairs": sp.pairs,
        "pass_cost": None if sp.pass_cost is None else round(sp.pass_cost, 4), "raw_ratio": round(sp.raw_ratio, 4),
        "same_length": sp.same_length, "text": times_text(sp.ratio)}
    q = state.quality
    quality = None if q is None else {
        "standard_nll": None if q.standard_nll is None else round(q.standard_nll, 4),
        "mtp_nll": None if q.mtp_nll is None else round(q.mtp_nll, 4),
        "nll_gap": None if q.gap is None else round(q.gap, 4),
        "standard_repeats": q.standard_repeats, "mtp_repeats": q.mtp_repeats,
        "units": "mean negative log-likelihood per token (nats) under the model, adapter off"}
    out = {"phase": state.phase, "status": status, "turn": state.turn.number, "error": state.error,
           "model": state.turn.lm.source, "prompt_tokens": len(state.turn.prompt_ids),
           "max_new_tokens": state.turn.max_new_tokens, "standard": side(state.standard, "standard"),
           "mtp": side(state.mtp, state.strategy.spec), "identical": state.identical,
           "parted_at": state.parted_at, "quality": quality, "speed": speed}
    if sp is not None:
        out["standard"]["timing"] = _timing_dict(sp.standard)
        out["mtp"]["timing"] = _timing_dict(sp.mtp)
        out["headline"], out["warning"] = headline(state)
    if state.strategy.verifies:
        out["mtp"].update({"mean_acceptance_length": round(state.mtp.mean_acceptance_length, 4),
                           "draft_acceptance_rate": state.mtp.draft_acceptance_rate,
                           "acceptance_by_position": state.mtp.acceptance_by_position})
    if state.turn.shape is not None:
        sh = state.turn.shape
        out["shape"] = {"k_max": sh.k_max, "layout": sh.layout, "expected_ratio": round(sh.speedup, 4),
                        "acceptance_by_position": list(sh.acceptance), "acceptance_source": sh.source,
                        "k_max_limit": sh.limit}
    return out


def _timing_dict(t: SideTiming | None) -> dict | None:
    """A side's timing by the page's one method (seconds), for the summary."""
    if t is None:
        return None
    return {"prefill_s": round(t.prefill, 6), "pass_s": None if t.per_pass is None else round(t.per_pass, 6),
            "seconds": round(t.seconds, 6), "tokens_per_second": round(t.tokens_per_second, 3),
            "measured_s": round(t.measured, 6)}
