"""Concurrency benchmark: N requests arriving together, served by one :class:`~model.engine.batch.BatchRunner`
(shared forward passes) against the same requests one by one.

For each concurrency level and strategy: the aggregate tokens/s (all requests' new tokens over the wall-clock
seconds from the first pass to the last), the median per-request tokens/s (its tokens over the seconds until it
finished), rows per shared pass, the ratio to standard decoding at the same level, and whether every request's
tokens equal its solo run (``identical_to_solo``). Requests use distinct prompts (cycled from the data).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

from ..engine.batch import BatchRunner
from ..engine.decoding import Decoder, run


def concurrency_bench(lm: Any, prompts: Sequence[str], strategies: Sequence[Any], levels: Sequence[int],
                      max_new_tokens: int = 64, max_rows: int = 256) -> list[dict]:
    """Serve ``n`` requests at once for each ``n`` in ``levels`` and each strategy (module docstring).

    Returns:
        One dict per (level, strategy): ``concurrency``, ``strategy``, ``aggregate_tokens_per_second``,
        ``median_request_tokens_per_second``, ``rows_per_pass``, ``passes``, ``identical_to_solo`` (list of
        bools), ``ratio_to_standard`` (None without a standard row at that level).

    Raises:
        ValueError: no prompts, a level below 1, or a model off our kernels (:class:`BatchRunner`).
    """
    if not prompts:
        raise ValueError("No prompts to benchmark.")
    if any(n < 1 for n in levels):
        raise ValueError(f"concurrency levels must be >= 1, got {list(levels)!r}")
    ids = [lm.prompt_ids(p) for p in prompts]
    solo: dict[tuple[str, int], list[int]] = {}
    rows_out = []
    for n in levels:
        level_rows = []
        for s in strategies:
            req = [ids[i % len(ids)] for i in range(n)]
            for i, r in enumerate(req):
                key = (s.spec, i % len(ids))
                if key not in solo:
                    solo[key] = run(lm, r, s, max_new_tokens).token_ids
            runner = BatchRunner(lm, max_rows=max_rows, max_sessions=max(n, 1))
            decs = [Decoder(lm, r, s, max_new_tokens) for r in req]
            for d in decs:
                runner.add(d)
            t0 = time.perf_counter()
            finished: dict[Decoder, float] = {}
            passes, rows = 0, 0
            while runner.pending:
                res = runner.step()
                passes += 1
                rows += res.rows
                now = time.perf_counter()
                for d in decs:
                    if d.done and d not in finished:
                        finished[d] = now - t0
            wall = time.perf_counter() - t0
            tokens = sum(len(d.generated) for d in decs)
            per_req = [len(d.generated) / finished[d] for d in decs if finished.get(d)]
            level_rows.append({
                "concurrency": n, "strategy": s.spec, "aggregate_tokens_per_second": tokens / wall,
                "median_request_tokens_per_second": statistics.median(per_req) if per_req else 0.0,
                "rows_per_pass": rows / max(passes, 1), "passes": passes,
                "identical_to_solo": [d.generated == solo[(s.spec, i % len(ids))] for i, d in enumerate(decs)],
            })
        std = next((r for r in level_rows if r["strategy"] == "standard"), None)
        for r in level_rows:
            r["ratio_to_standard"] = (r["aggregate_tokens_per_second"] / std["aggregate_tokens_per_second"]
                                      if std else None)
        rows_out += level_rows
    return rows_out


def format_concurrency(rows: Sequence[dict]) -> str:
    """The rows as a plain-text table."""
    head = f"{'n':>3} {'strategy':<22} {'aggregate tok/s':>16} {'median req tok/s':>17} {'x standard':>11} " \
           f"{'rows/pass':>10} {'identical':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "" if r["ratio_to_standard"] is None else f"{r['ratio_to_standard']:.2f}"
        same = f"{sum(r['identical_to_solo'])}/{len(r['identical_to_solo'])}"
        lines.append(f"{r['concurrency']:>3} {r['strategy']:<22} {r['aggregate_tokens_per_second']:>16.1f} "
                     f"{r['median_request_tokens_per_second']:>17.1f} {ratio:>11} {r['rows_per_pass']:>10.1f} "
                     f"{same:>10}")
    return "\n".join(lines)
