"""What a turn's speed means, in words: the headline (speed and its cost in one sentence), "How speed is measured",
the status line, and the turn's plain JSON summary for API clients (no Gradio, no model code)."""

from __future__ import annotations

import html
import math
from typing import Any

from model.engine.decoding import PREFILL_CHUNK, GenerationResult

from .render import dtype_name, esc, num_text
from .timing import MIN_PAIRS_FOR_INTERVAL, SideTiming, SpeedEstimate
from .turn import TurnState

#: The status line after Clear (the page's answer to Clear, and a cleared turn's last update).
CLEARED = "Cleared: a new conversation starts with your next message."


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
def _as_reported(ratio: float) -> float:
    """``ratio`` to the 4 decimals the API reports it with: the words read from it are the words a client reading
    the reported ratio gets."""
    return round(ratio, 4)


def times_text(ratio: float) -> str:
    """``1.32× faster``, ``2.80× slower`` or ``1.00× (the same speed)``, read from ``ratio`` as reported
    (:func:`_as_reported`)."""
    if not math.isfinite(ratio) or ratio <= 0:
        return "unknown"
    ratio = _as_reported(ratio)
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

    A warning whenever the MTP answer diverges from standard decoding's and is less likely under the model,
    or degenerates into repetition: such an answer never reads as a plain win. Before both sides are
    scored the sentence says how the answers agree so far.

    Returns:
        ``(sentence, warn)``, e.g. ``("ConfAdapt tau=0.90 k_max=4: 1.32× faster, identical answer.", False)``.
    """
    label, sp = state.strategy.label, state.speed
    if sp is None and state.final:  # ended in the prompt or before both sides' first tokens: nothing to compare
        how = {"stopped": "was stopped", "cleared": "was cleared", "error": "failed"}.get(state.phase, "ended")
        return f"{label} vs standard decoding: no speed to compare, the turn {how} before both sides' first tokens.", False
    if sp is None and state.prefill is not None:
        done, total = state.prefill
        return (f"{label} vs standard decoding: reading the prompt, {done:,} of {total:,} tokens (both sides' prompts "
                "together)…"), False
    if sp is None:
        return f"{label} vs standard decoding: waiting for both sides’ first tokens…", False
    if sp.low is None or sp.high is None:  # too few paired passes: a ratio of them (or of the prefills) is no result
        speed = _too_few_text(sp)
    elif _no_clear_difference(sp):  # a ratio inside noise is not a result: say so in the headline itself
        speed = f"about the same speed ({times_text(sp.ratio)}; its 90% interval includes equal speed)"
    else:
        speed = times_text(sp.ratio) + _against_the_sums(sp)
    q, parted, warn = state.quality, state.parted_at, False
    if not state.turn.sampling.greedy:
        cost, warn = _sampled_cost(state)
    elif state.identical and state.final:
        cost = "identical answer" + (" (lossless)" if state.strategy.lossless else "")
    elif parted is None:
        n = min(len(state.standard.token_ids), len(state.mtp.token_ids))
        cost = f"identical so far (the first {n} tokens)"
    elif q is None or q.gap is None:
        cost = f"the answer diverges at token {parted + 1}" + ("" if state.final else " (quality once both are done)")
    elif q.gap > NLL_TIE:
        cost = (f"but the answer diverges at token {parted + 1} and is {q.gap:.2f} nats/token less likely under the "
                f"model ({q.mtp_nll:.2f} vs {q.standard_nll:.2f})")
        warn = True
    elif q.gap < -NLL_TIE:
        cost = (f"the answer diverges at token {parted + 1} and is {-q.gap:.2f} nats/token more likely under the model "
                f"({q.mtp_nll:.2f} vs {q.standard_nll:.2f})")
    else:
        cost = (f"the answer diverges at token {parted + 1}, equally likely under the model ({q.mtp_nll:.2f} vs "
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


def _sampled_cost(state: TurnState) -> tuple[str, bool]:
    """The headline's cost when both sides sample: the draws differ, so no answer is "identical"; lossless keeps
    standard sampling's distribution, and any strategy's answer is compared by its likelihood under the model."""
    q, lossless = state.quality, state.strategy.lossless
    what = ("lossless: the same distribution as standard sampling, different draws" if lossless
            else "sampled: different draws")
    if q is None or q.gap is None:
        return what + ("" if state.final else " (quality once both are done)"), False
    if q.gap > NLL_TIE and not lossless:
        return (f"{what}, and its answer is {q.gap:.2f} nats/token less likely under the model ({q.mtp_nll:.2f} vs "
                f"{q.standard_nll:.2f})"), True
    if q.gap < -NLL_TIE or q.gap > NLL_TIE:
        more = "more" if q.gap < 0 else "less"
        return f"{what}; this draw is {abs(q.gap):.2f} nats/token {more} likely ({q.mtp_nll:.2f} vs {q.standard_nll:.2f})", False
    return f"{what}, equally likely under the model ({q.mtp_nll:.2f} vs {q.standard_nll:.2f})", False


def direction(ratio: float) -> int:
    """1 faster, -1 slower, 0 the same speed (as :func:`times_text` words it, to two decimals)."""
    if not math.isfinite(ratio) or ratio <= 0 or round(_as_reported(ratio), 2) == 1.0:
        return 0
    return 1 if ratio > 1 else -1


def pairs_text(n: int) -> str:
    """``1 pair of passes`` / ``3 pairs of passes``."""
    return f"{n} pair{'' if n == 1 else 's'} of passes"


def _no_clear_difference(sp: SpeedEstimate) -> bool:
    """The headline's ratio reads faster or slower, but its 90% interval includes equal speed."""
    return sp.low is not None and sp.high is not None and sp.low <= 1.0 <= sp.high and direction(sp.ratio) != 0


def _too_few_text(sp: SpeedEstimate) -> str:
    """The headline's speed without an interval (fewer than :data:`~app.timing.MIN_PAIRS_FOR_INTERVAL` paired
    passes): no verdict, the pairs' ratio in parentheses and, where they point the other way, the sums'. An answer
    of one or two tokens has no pair at all: its ratio would be the prefills' alone."""
    seen = f": {times_text(sp.ratio)} over {'it' if sp.pairs == 1 else 'them'}" if sp.pairs else ""
    sums = f"; the measured sums read {times_text(sp.raw_ratio)}" if sp.pairs and _sums_disagree(sp) else ""
    return f"too few passes to tell the speed ({pairs_text(sp.pairs)}{seen}{sums})"


def _sums_disagree(sp: SpeedEstimate) -> bool:
    """The ratio and the measured sums point different ways: one faster, the other slower."""
    return direction(sp.ratio) * direction(sp.raw_ratio) < 0


def _against_the_sums(sp: SpeedEstimate) -> str:
    """Where the headline's ratio and the measured sums point different ways (:func:`_sums_disagree`), a
    parenthesis that says so and why; else nothing."""
    if not _sums_disagree(sp):
        return ""
    # (too few pairs: _too_few_text; an interval that includes equal speed: _no_clear_difference)
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
        if _no_clear_difference(sp):
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
    verifies = state.turn.strategy.lossless
    parted = state.parted_at
    sampling = state.turn.sampling
    if not sampling.greedy:
        agree = (f"both sides sample ({sampling.label}, seed {sampling.seed}), so their tokens differ by chance: "
                 + ("lossless verification keeps the distribution of standard sampling, not its draws"
                    if verifies else "compare the answers by their likelihood"))
    elif state.identical:
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
                    f"not timed): standard {num_text(q.standard_nll, '.2f')}, MTP {num_text(q.mtp_nll, '.2f')}")
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
    return (f"the answers diverge at token {i + 1}{close}: in {dt} a pass over several tokens rounds differently "
            "from a one-token pass, and there the two best candidates were nearly tied; in float32 they are identical")


def cut_sides(state: TurnState) -> list[str]:
    """The sides (``"standard"``, ``"MTP"``) whose answer ended at max new tokens, not at a stop token or
    stop string: the answer is cut, not finished."""
    limit = state.turn.max_new_tokens
    return [name for name, res in (("standard", state.standard), ("MTP", state.mtp))
            if res.passes and not res.passes[-1].stopped and res.new_tokens >= limit]


def _cut_text(state: TurnState) -> str:
    """`` Both answers were cut at max new tokens (128)…`` for a finished turn whose answers hit the limit."""
    cut = cut_sides(state)
    if not cut:
        return ""
    which = "Both answers were" if len(cut) == 2 else f"The {cut[0]} answer was"
    return (f" {which} cut at max new tokens ({state.turn.max_new_tokens}) before the model ended "
            f"{'them' if len(cut) == 2 else 'it'}; raise it for longer answers.")


def turn_status(state: TurnState) -> tuple[str, str]:
    """(text, kind) of the status line for a turn's state."""
    n, label, src = state.turn.number, state.strategy.label, state.turn.lm.source
    if state.phase == "running" and state.prefill is not None:
        done, total = state.prefill
        reused = state.turn.sides["standard"].reused if state.turn.sides else 0
        kept = f"; {reused:,} tokens of the conversation reused from the last turn" if reused else ""
        if total <= PREFILL_CHUNK:
            return f"Turn {n}: reading the prompt ({total:,} tokens, both sides){kept}…", "info"
        return (f"Turn {n}: reading the prompt in chunks of {PREFILL_CHUNK} tokens, {done:,} of {total:,} tokens "
                f"(both sides' prompts together; Stop acts between chunks){kept}…", "info")
    if state.phase == "running":
        return f"Turn {n}: running standard vs {label} on {src}…", "info"
    if state.phase == "done":
        return (f"Turn {n}: done in {state.wall_seconds:.1f} s wall-clock (both sides, passes alternating, and one "
                f"scoring pass per answer).{_cut_text(state)}", "info")
    if state.phase == "stopped":
        return (f"■ Turn {n}: stopped after {state.standard.new_tokens} standard and {state.mtp.new_tokens} MTP "
                "tokens. The partial answers stay in the conversation; send a new message to continue.", "info")
    if state.phase == "cleared":
        return CLEARED, "info"
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

    cut = cut_sides(state)
    sp = state.speed
    speed = None if sp is None else {
        "ratio": _as_reported(sp.ratio), "low": None if sp.low is None else _as_reported(sp.low),
        "high": None if sp.high is None else _as_reported(sp.high), "pairs": sp.pairs,
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
           "sampling": state.turn.sampling.to_dict(),
           "parted_at": state.parted_at, "quality": quality, "speed": speed}
    out["standard"]["cut_at_max_new_tokens"] = "standard" in cut
    out["mtp"]["cut_at_max_new_tokens"] = "MTP" in cut
    if sp is not None:
        out["standard"]["timing"] = _timing_dict(sp.standard)
        out["mtp"]["timing"] = _timing_dict(sp.mtp)
        out["headline"], out["warning"] = headline(state)
    if state.strategy.lossless:
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


def agent_summary(result: dict) -> dict:
    """The small result an agent gets (the MCP tool ``chat``): the turn's state and status, the headline in plain
    words, each answer's text and counts, the speedup and the sampling settings; from :func:`summary`'s value.

    Keys: ``phase``, ``status``, ``headline``, ``warning``, ``speedup`` (the headline's ratio, None before both
    sides ran), ``identical``, ``sampling``, ``standard`` and ``mtp`` (each ``text``, ``new_tokens``,
    ``forward_passes``, ``effective_k``, ``tokens_per_second``; ``mtp`` also ``strategy``).
    """
    def side(d: dict | None) -> dict | None:
        if not d:
            return None
        out = {k: d.get(k) for k in ("text", "new_tokens", "forward_passes", "effective_k", "tokens_per_second")}
        if d.get("strategy") != "standard":
            out["strategy"] = d.get("strategy")
        return out

    speed = result.get("speed") or {}
    return {"phase": result.get("phase"), "status": _plain(result.get("status", "")), "headline": result.get("headline"),
            "warning": bool(result.get("warning", False)), "speedup": speed.get("ratio"),
            "identical": result.get("identical"), "sampling": result.get("sampling"),
            "standard": side(result.get("standard")), "mtp": side(result.get("mtp"))}


def _plain(text: Any) -> str:
    """A status as words (the page's HTML tags and entities removed)."""
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", str(text or ""))).strip()
