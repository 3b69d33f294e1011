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
from model.engine.decoding import DraftCheck, GenerationResult, PassRecord
from model.engine.records import FEW_CHECKS, by_position_text
from model.engine.strategies import Strategy

from .device import LosslessShape, WidthProfile
from .timing import SideTiming, side_timing

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

    Where an MTP answer differs from the standard one and the conversation goes on after it, a note says that
    the next turn continues from the standard answer (not after the last answer: nothing continues yet).
    """
    rows = []
    for i, m in enumerate(history):
        content = m.get("mtp", m["content"]) if side == "mtp" and m["role"] == "assistant" else m["content"]
        rows.append(_bubble(m["role"], content))
        continued = message is not None or any(later["role"] == "user" for later in history[i + 1:])
        if side == "mtp" and m["role"] == "assistant" and "mtp" in m and m["mtp"] != m["content"] and continued:
            rows.append('<div class="mtp-note">The conversation continues from the standard answer (left), '
                        "so both panes answer the same prompts.</div>")
    if message is not None:
        rows.append(_bubble("user", message))
        rows.append(_bubble("assistant", answer or "", cursor=running))
    body = "".join(rows) or '<div class="mtp-empty">No messages yet.</div>'
    return (f'<section class="mtp-pane" data-side="{side}" aria-label="{esc(title)}">'
            f'<header class="mtp-pane-title">{esc(title)}</header>'
            f'<div class="mtp-scroll" role="log"><div class="mtp-msgs">{body}</div></div></section>')


#: What an assistant bubble without text says once its answer is over: one or two tokens can be the first bytes
#: of a character (an emoji is up to four), which the answer holds back until the character is complete.
EMPTY_ANSWER_NOTE = "(no text: the answer stopped before its first complete character)"


def _bubble(role: str, text: str, cursor: bool = False) -> str:
    who = "user" if role == "user" else ("system" if role == "system" else "bot")
    tail = '<span class="mtp-cursor" aria-hidden="true">▍</span>' if cursor else ""
    body = message_html(text)
    if who == "bot" and not text and not cursor:
        body = f'<span class="mtp-empty-answer">{esc(EMPTY_ANSWER_NOTE)}</span>'
    return (f'<div class="mtp-msg mtp-{who}" data-role="{who}" dir="auto">'
            f'<div class="mtp-msg-text">{body}</div>{tail}</div>')


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
                    "accepted draft 1, 2, 3, … (a draft after a rejected one counts as rejected); a position checked "
                    f"fewer than {FEW_CHECKS} times shows its counts, e.g. 0 of 2"),
}


def num_text(x: float | None, fmt: str) -> str:
    """``x`` formatted with ``fmt``, or a dash when it is None or not finite (a counter not measured yet)."""
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
        "ms/pass": num_text(None if t.per_pass is None else 1000 * t.per_pass, ".0f"),
        "time s": f"{t.seconds:.2f}",
        "tok/s": f"{t.tokens_per_second:.1f}",
        "measured s": f"{t.measured:.2f}",
    }
    if verifies:
        out["acc. rate"] = num_text(result.draft_acceptance_rate, ".2f")
        out["by position"] = by_position_text(*result.drafts_by_position) or "–"
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
    if strategy is not None and strategy.lossless:
        if rec.fed_drafts:
            check = rec.verification or DraftCheck()
            head += f"; {min(check.accepted, n)} of {rec.fed_drafts} drafts accepted"
            head += ", then the model's correction" if check.correction is not None else ", then the model's next token"
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
        done = sum(1 for r in records if r.kept)
        what = (f"This answer's {done} forward pass{'es' if done != 1 else ''} made no complete character to colour."
                if done else "The MTP answer, coloured by forward pass, appears here.")
        return f'<div class="mtp-fig1-wrap"><div class="mtp-fig1-empty">{esc(what)}</div></div>'
    legend = "".join(f'<span class="mtp-legend-item"{_kept_style(w)}>{w}</span>' for w in sorted(counts))
    return ('<div class="mtp-fig1-wrap"><div class="mtp-legend"><span>tokens per forward pass:</span> '
            f'{legend}<span class="mtp-legend-hint">(hover a span for its pass)</span></div>'
            f'<div class="mtp-fig1" dir="auto">{"".join(spans)}</div></div>')


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
    "ConfAdapt": ("<b>ConfAdapt</b>: each forward pass proposes up to k_max tokens; it keeps the leading run whose "
                  "confidence is at least tau, counted from the first proposal (the model's ordinary next token), "
                  "which it keeps always: when the model is unsure of its next token, the pass keeps that one only."),
    "static k": "<b>static k</b>: each forward pass keeps exactly its first k proposals, whatever their confidence.",
    "lossless": ("<b>lossless</b> (self-speculative verification): each pass feeds the previous pass's mask "
                 "proposals as drafts, keeps the drafts equal to the model's own greedy choice, plus its next token. "
                 "<b>Its answer is standard decoding's</b>; only the number of forward passes changes. Exactly so "
                 "in float32, and in bf16 on our CPU kernels (every row of a pass computes what a one-token pass "
                 "computes, bit for bit); on the library path (torch, a GPU) in bf16 a pass over several tokens "
                 "rounds differently from a one-token pass, so where two candidates are nearly tied the answers can "
                 "part (the page says where; Model › Precision › float32 makes them identical to the bit)."),
}


#: When the controls take effect (a turn reads them once, when it starts; moving tau mid-answer changed nothing
#: on the page and said nothing).
CONTROLS_APPLY = "Changed controls apply from your next message: an answer keeps the settings it started with."


def strategy_help_html(choice: str, shape_line: str = "") -> str:
    """The explanation line for the chosen strategy (for lossless, then the shape line: :func:`shape_text`), and
    when changed controls apply (:data:`CONTROLS_APPLY`)."""
    extra = f'<div class="mtp-shape">{esc(shape_line)}</div>' if shape_line and choice == "lossless" else ""
    return (f'<div class="mtp-strategy-help">{STRATEGY_HELP.get(choice, "")} <i>{esc(CONTROLS_APPLY)}</i>'
            f'{extra}</div>')


def width_text(profile: WidthProfile, width: int = 4, *, where: bool = True) -> str:
    """``a pass of 4 tokens costs 1.30× (1.25–1.36 over 40 pairs) a pass of 1 here (bfloat16, cpu)``: the median of
    the ratios of passes run back to back and their middle half (without the place when not ``where``)."""
    spread = profile.spread(width)
    n = profile.ratios.count(width)
    around = f" ({spread[0]:.2f}–{spread[1]:.2f} over {n} pairs)" if spread else ""
    text = f"a pass of {width} tokens costs {profile.ratio(width):.2f}×{around} a pass of 1"
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
            "one-token pass costs (a GPU, or a CPU with bf16 instructions); this CPU has none, so expect the "
            f"MTP side to run slower than standard decoding. Fastest lossless setting here: {esc(best)}.</div>")


def status_html(text: str, *, kind: str = "info") -> str:
    """The status line (``kind``: info, error)."""
    if kind == "error":
        return f'<div class="mtp-status mtp-error" role="alert">⚠️ <b>Error:</b> {esc(text)}</div>'
    return f'<div class="mtp-status">{esc(text)}</div>'
