"""The bench's report as plain text (:func:`model.evaluation.speed.bench`): tokens per second by method, the width
curve, bandwidth, row exactness, the kernels and the machine's load.
"""

from __future__ import annotations

from pathlib import Path

from ..engine.sampling import Sampling
from .accuracy_report import by_position_cell


def format_table(report: dict) -> str:
    """The report as plain-text tables (tokens/s per method; width curve; bandwidth)."""
    c = report["config"]
    lw = max([34] + [len(r["label"]) for r in report["methods"]])  # the widest label sets the first column
    head = f"{'method':<{lw}} {'tokens/s':>9} {'x HF':>6} {'eff. k':>7} {'passes/s':>9} {'new tokens':>10}"
    lines = [head, "-" * len(head)]
    for r in report["methods"]:
        drafts = "" if r.get("draft_acceptance_rate") is None else (
            f"  drafts accepted {r['draft_acceptance_rate']:.2f} (by position {by_position_cell(r)})")
        lines.append(f"{r['label']:<{lw}} {r['tokens_per_second']:>9.1f} {r['ratio_to_hf']:>6.2f} "
                     f"{r['effective_k']:>7.2f} {r['forward_passes_per_second']:>9.1f} {r['tokens']:>10d}{drafts}")
    lines.append(f"median of {c['repeats']} repeats x {c['prompts']} prompts x {c['max_new_tokens']} new tokens; "
                 f"{c['device']} {c['dtype']}, {c['torch_threads']} torch threads; {c['forward_path']}; "
                 f"{Sampling(**c.get('sampling', {})).label}")
    lines.append(f"baseline: {c['hf_baseline']}; weights {c['weight_bytes'] / 1e6:.0f} MB")
    if report["standard_matches_hf"] is not None:
        lines.append(f"standard output == HF generate output: {report['standard_matches_hf']}")
    lc = report.get("llama_cpp") or {}
    if lc.get("note"):
        lines.append(lc["note"])
    elif lc.get("tokens_equal_to_standard") is not None:
        lines.append(f"llama.cpp ({Path(lc['gguf']).name}) greedy tokens equal to our standard decoding's: "
                     f"{lc['tokens_equal_to_standard']:.1%} of positions")
    if lc.get("caveat"):
        lines.append(lc["caveat"])
    for spec, same in report.get("verify_matches_standard", {}).items():
        lines.append(f"{spec} output == standard output (lossless): {same}")
    lines.append("new tokens: generated in one repeat over all prompts; a method that hits a stop token early "
                 "spends a larger share of its time on the prefill")
    w = report.get("width")
    if w:
        lines.append("")
        lines.append(f"ms per forward pass by tokens fed (cache of {w['context_tokens']} tokens; "
                     "x = ratio to our 1-token base pass)")
        lw = max([40] + [len(row["label"]) + 1 for row in w["rows"]])  # the longest label, then the columns
        cells = [[f"{ms:.1f} ({x:.2f}x)" if row["ratio"] else f"{ms:.1f}"
                  for ms, x in zip(row["ms"], row["ratio"] or [0] * len(row["ms"]))] for row in w["rows"]]
        cw = max([14] + [len(c) + 1 for row in cells for c in row])  # the widest cell (12.34x, 1234.5 ms)
        wh = f"{'':<{lw}}" + "".join(f"{t:>{cw}}" for t in w["widths"])
        lines += [wh, "-" * len(wh)]
        for row, row_cells in zip(w["rows"], cells):
            lines.append(f"{row['label']:<{lw}}" + "".join(f"{c:>{cw}}" for c in row_cells))
    b = report.get("bandwidth")
    if b:
        lines.append("")
        lines.append(f"memory bandwidth measured: {b['measured_bytes_per_second'] / 1e9:.1f} GB/s ({b['measured_by']})")
        for name, label in (("ours_base", "ours"), ("hf_plain", "transformers")):
            if name in b:
                x = b[name]
                lines.append(f"bandwidth achieved, {label}: {b['pass_bytes'] / 1e6:.0f} MB of weights in "
                             f"{x['ms_per_pass']:.1f} ms = {x['bytes_per_second'] / 1e9:.1f} GB/s "
                             f"({x['fraction']:.0%} of measured)")
    ex = report.get("row_exactness")
    if ex:
        lines.append("")
        lines.append("rows of a T-token pass bit-identical to one-token passes of the same tokens after the same cache: "
                     + ", ".join(f"T={e['width']}: MTP {e['mtp_equal']}/{e['width']}, real {e['real_equal']}/{e['width']}"
                                 for e in ex))
    if report.get("kernels"):
        lines.append(f"kernels: {report['kernels']}")
    lb, la = c.get("load_average_before"), c.get("load_average_after")
    if lb:
        lines.append(f"load average (1/5/15 min) before {lb}, after {la}; cpu: {c.get('cpu')}")
    return "\n".join(lines)
