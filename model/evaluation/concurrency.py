"""Concurrency benchmark: N requests served by one :class:`~model.engine.batch.BatchRunner` (shared forward
passes), each checked against the same request run alone.

Two arrival modes (``arrivals``):

* ``together``: all N requests are there before the first shared pass.
* ``staggered``: request ``i`` (0-based) arrives after ``i`` shared passes, i.e. just before pass ``i``; its
  prefill joins that pass beside the earlier requests' decoding rows. Should every request that arrived be
  done before the next one is due, the next one arrives at once (no empty passes are counted).

For each concurrency level, arrival mode and strategy: the aggregate tokens/s (all requests' new tokens over the
wall-clock seconds from the first pass to the last), the median per-request tokens/s (its tokens over the
seconds from its arrival until it finished), mean rows per shared pass, the ratio of the aggregate to standard
decoding's at the same level and arrival mode (all strategies of a level run one after another in the same
process, so a ratio compares runs made side by side), and whether every request's tokens equal its solo run
(``identical_to_solo``). Requests use distinct prompts while there are enough (cycled from the data).

A run of one or two requests lasts a second or two, so a burst of load from another job can halve it:
``repeats`` serves each (level, arrival mode) group that many times, the strategies interleaved (their order
rotated each round, so none always runs first), and reports the median aggregate of the rounds (``"auto"``:
``ceil(max(levels) / n)`` rounds at level ``n``, so every level serves as many requests as the largest).
Beside wall-clock rates, the rates over this process's CPU seconds (``time.process_time``): with one torch
thread on a machine that other jobs load, they leave out the time the process waited for a core.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Sequence

from ..engine.batch import BatchRunner
from ..engine.decoding import Decoder, run
from ..engine.sampling import GREEDY, Sampling, for_request

#: The arrival modes :func:`concurrency_bench` knows (module docstring).
ARRIVALS = ("together", "staggered")
#: Default cap on the rows of one shared pass in this benchmark (a wider pass waits; see BatchRunner).
MAX_ROWS = 256


def _serve(lm: Any, req: Sequence[Sequence[int]], strategy: Any, max_new_tokens: int, max_rows: int,
           arrival: str, sampling: Sampling = GREEDY) -> dict:
    r"""Serve ``req`` (prompt ids) with ``strategy`` in shared passes; timings, rows and each request's tokens
    (request ``i`` sampled with :func:`~model.engine.sampling.for_request`\ ``(sampling, i)``)."""
    n = len(req)
    runner = BatchRunner(lm, max_rows=max_rows, max_sessions=max(n, 1))
    decs = [Decoder(lm, r, strategy, max_new_tokens, for_request(sampling, i)) for i, r in enumerate(req)]
    arrived: dict[Decoder, float] = {}
    arrived_at_pass: list[int] = []
    finished: dict[Decoder, float] = {}
    passes = rows = 0
    nxt = 0  # next request to arrive
    t0, c0 = time.perf_counter(), time.process_time()
    while nxt < n or runner.pending:
        due = n if arrival == "together" else passes + 1  # staggered: request i arrives before pass i
        if not runner.pending:
            due = max(due, nxt + 1)  # nobody is being served: the next request arrives now
        now = time.perf_counter()
        while nxt < min(due, n):
            runner.add(decs[nxt])
            arrived[decs[nxt]] = now
            arrived_at_pass.append(passes)
            nxt += 1
        res = runner.step()
        passes += 1
        rows += res.rows
        now = time.perf_counter()
        for d in decs[:nxt]:
            if d.done and d not in finished:
                finished[d] = now
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    per_req = [len(d.generated) / (finished[d] - arrived[d]) for d in decs if finished[d] > arrived[d]]
    tokens = sum(len(d.generated) for d in decs)
    return {"tokens": tokens, "seconds": wall, "cpu_seconds": cpu, "passes": passes, "rows": rows, "per_request": per_req,
            "generated": [list(d.generated) for d in decs], "errors": len(runner.errors),
            "arrived_at_pass": arrived_at_pass}


def _solo_key(strategy: Any, i: int, prompts: int, sampling: Sampling) -> tuple:
    """Which solo run request ``i`` must equal: its prompt's (greedy), or its prompt's with its own seed."""
    return (strategy.spec, i % prompts, None if sampling.greedy or sampling.seed is None else i)


def concurrency_bench(lm: Any, prompts: Sequence[str], strategies: Sequence[Any], levels: Sequence[int],
                      max_new_tokens: int = 64, max_rows: int = MAX_ROWS,
                      arrivals: Sequence[str] = ("together",), repeats: int | str = 1,
                      sampling: Sampling = GREEDY) -> list[dict]:
    """Serve ``n`` requests for each ``n`` in ``levels``, each arrival mode and each strategy (module docstring).

    Args:
        lm: a model on our CPU kernels (:class:`BatchRunner`).
        prompts: prompt texts, cycled when a level has more requests than prompts.
        strategies: from :mod:`model.engine.strategies`; include ``standard()`` for the ratios.
        levels: request counts.
        max_new_tokens: new tokens per request.
        max_rows: most rows in one shared pass.
        arrivals: arrival modes from :data:`ARRIVALS`, each run for every level.
        repeats: rounds per (level, arrival mode), or ``"auto"`` (module docstring).
        sampling: greedy by default; else request ``i`` samples with the seed advanced by ``i``, and its solo run
            (the same seed) is what it must equal.

    Returns:
        One dict per (level, arrival, strategy), in that nesting order: ``concurrency``, ``arrival``,
        ``strategy``, ``repeats``, ``aggregate_tokens_per_second`` (median of the rounds),
        ``aggregate_tokens_per_second_rounds``, ``median_request_tokens_per_second`` (over every request of
        every round), ``request_tokens_per_second`` (per request, every round), ``rows_per_pass`` (mean),
        ``passes`` (of one round: the schedule does not depend on timing), ``tokens`` and ``seconds`` (all
        rounds), ``aggregate_tokens_per_cpu_second`` (median of the rounds, over this process's CPU seconds),
        ``errors``, ``arrived_at_pass`` (the shared pass each request joined before, 0-based),
        ``identical_to_solo`` (one bool per request: its tokens equalled its solo run's in every round),
        ``ratio_to_standard`` (the aggregate over standard's at the same level and arrival mode; None without a
        standard row there), ``ratio_to_standard_cpu`` (the same over CPU seconds).

    Raises:
        ValueError: no prompts, a level below 1, an unknown arrival mode, repeats below 1, or a model off our
            kernels.
    """
    if not prompts:
        raise ValueError("No prompts to benchmark.")
    if any(n < 1 for n in levels):
        raise ValueError(f"concurrency levels must be >= 1, got {list(levels)!r}")
    if repeats != "auto" and (not isinstance(repeats, int) or repeats < 1):
        raise ValueError(f"repeats must be 'auto' or an integer >= 1, got {repeats!r}")
    bad = [a for a in arrivals if a not in ARRIVALS]
    if bad or not arrivals:
        raise ValueError(f"arrivals must be some of {', '.join(ARRIVALS)}; got {list(arrivals)!r}")
    ids = [lm.prompt_ids(p) for p in prompts]
    solo: dict[tuple[str, int], list[int]] = {}
    rows_out = []
    for n in levels:
        req = [ids[i % len(ids)] for i in range(n)]
        for s in strategies:  # the solo runs first, outside the timed runs
            for i in range(n):
                key = _solo_key(s, i, len(ids), sampling)
                if key not in solo:
                    solo[key] = run(lm, req[i], s, max_new_tokens, for_request(sampling, i)).token_ids
        rounds = -(-max(levels) // n) if repeats == "auto" else int(repeats)
        for arrival in arrivals:
            outs: dict[str, list[dict]] = {s.spec: [] for s in strategies}
            for k in range(rounds):
                for s in strategies[k % len(strategies):] + strategies[: k % len(strategies)]:
                    outs[s.spec].append(_serve(lm, req, s, max_new_tokens, max_rows, arrival, sampling))
            rows_out += _group_rows(n, arrival, strategies, outs, rounds, solo, len(ids), sampling)
    return rows_out


def _group_rows(n: int, arrival: str, strategies: Sequence[Any], outs: dict[str, list[dict]], rounds: int,
                solo: dict[tuple, list[int]], prompts: int, sampling: Sampling) -> list[dict]:
    """The rows of one (level, arrival mode) group, one per strategy (:func:`concurrency_bench`'s Returns):
    ``outs`` holds each strategy's :func:`_serve` results by spec, one per round; ``solo`` the solo runs' tokens
    by :func:`_solo_key`; ``prompts`` the number of distinct prompts."""
    group = []
    for s in strategies:
        runs = outs[s.spec]
        per_req = [x for o in runs for x in o["per_request"]]
        aggs = [o["tokens"] / o["seconds"] for o in runs]
        group.append({
            "concurrency": n, "arrival": arrival, "strategy": s.spec, "repeats": rounds,
            "aggregate_tokens_per_second": statistics.median(aggs),
            "aggregate_tokens_per_second_rounds": aggs,
            "aggregate_tokens_per_cpu_second": statistics.median(
                o["tokens"] / o["cpu_seconds"] for o in runs if o["cpu_seconds"] > 0) if any(
                o["cpu_seconds"] > 0 for o in runs) else None,
            "median_request_tokens_per_second": statistics.median(per_req) if per_req else 0.0,
            "request_tokens_per_second": per_req,
            "rows_per_pass": sum(o["rows"] for o in runs) / max(sum(o["passes"] for o in runs), 1),
            "passes": runs[0]["passes"], "tokens": sum(o["tokens"] for o in runs),
            "seconds": sum(o["seconds"] for o in runs), "errors": sum(o["errors"] for o in runs),
            "arrived_at_pass": runs[0]["arrived_at_pass"],
            "identical_to_solo": [all(o["generated"][i] == solo[_solo_key(s, i, prompts, sampling)]
                                      for o in runs) for i in range(n)],
        })
    std = next((r for r in group if r["strategy"] == "standard"), None)
    for r in group:
        r["ratio_to_standard"] = (r["aggregate_tokens_per_second"] / std["aggregate_tokens_per_second"]
                                  if std else None)
        cpu, std_cpu = r["aggregate_tokens_per_cpu_second"], std and std["aggregate_tokens_per_cpu_second"]
        r["ratio_to_standard_cpu"] = cpu / std_cpu if cpu and std_cpu else None
    return group


def concurrency_report(rows: Sequence[dict], **config: Any) -> dict:
    """The JSON report of :func:`concurrency_bench`'s ``rows``: ``{"concurrency": rows, "config": config,
    "ratios": {arrival: {strategy: {str(level): ratio}}}, "all_identical_to_solo": bool}`` (``config``: what
    the caller ran, e.g. model, threads, forward path; the load average now is added as ``load_average``)."""
    ratios: dict[str, dict[str, dict[str, float | None]]] = {}
    for r in rows:
        ratios.setdefault(r["arrival"], {}).setdefault(r["strategy"], {})[str(r["concurrency"])] = \
            r["ratio_to_standard"]
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {"concurrency": list(rows), "config": {**config, "load_average": load}, "ratios": ratios,
            "all_identical_to_solo": all(all(r["identical_to_solo"]) for r in rows)}


def dumps_strict(report: dict) -> str:
    """``report`` as strict JSON (no NaN or Infinity: ValueError if any value is not finite)."""
    return json.dumps(report, indent=1, allow_nan=False)


def format_concurrency(rows: Sequence[dict]) -> str:
    """The rows as a plain-text table, one line per (level, arrival, strategy)."""
    head = f"{'n':>3} {'arrival':<10} {'strategy':<22} {'aggregate tok/s':>16} {'median req tok/s':>17} " \
           f"{'x standard':>11} {'rows/pass':>10} {'identical':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "" if r["ratio_to_standard"] is None else f"{r['ratio_to_standard']:.2f}"
        same = f"{sum(r['identical_to_solo'])}/{len(r['identical_to_solo'])}"
        lines.append(f"{r['concurrency']:>3} {r.get('arrival', 'together'):<10} {r['strategy']:<22} "
                     f"{r['aggregate_tokens_per_second']:>16.1f} {r['median_request_tokens_per_second']:>17.1f} "
                     f"{ratio:>11} {r['rows_per_pass']:>10.1f} {same:>10}")
    return "\n".join(lines)


def format_ratios(rows: Sequence[dict], cpu: bool = False) -> str:
    """The MTP / standard ratios side by side: one line per level, per arrival mode standard's aggregate tok/s
    then each other strategy's ratio to it; a last column says whether every request equalled its solo run.
    ``cpu``: the rates over CPU seconds instead of wall-clock seconds."""
    agg, ratio = (("aggregate_tokens_per_cpu_second", "ratio_to_standard_cpu") if cpu
                  else ("aggregate_tokens_per_second", "ratio_to_standard"))
    arrivals = list(dict.fromkeys(r["arrival"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    others = [s for s in strategies if s != "standard"]
    cols = [(a, s) for a in arrivals for s in (["standard"] if "standard" in strategies else []) + others]
    by = {(r["concurrency"], r["arrival"], r["strategy"]): r for r in rows}
    label = {s: ("standard tok/cpu-s" if cpu else "standard tok/s") if s == "standard" else "x " + s
             for s in strategies}
    width = max(len(x) for x in label.values()) + 2
    top = "    " + "".join(f"{a:<{width}}" if i == 0 or cols[i - 1][0] != a else " " * width
                          for i, (a, _) in enumerate(cols))
    sub = "  n " + "".join(f"{label[s]:<{width}}" for _, s in cols) + "identical"
    lines = [f"MTP / standard, aggregate tokens per {'CPU' if cpu else 'wall-clock'} second (each level's "
             "strategies run side by side in one process)",
             top.rstrip(), sub, "-" * len(sub)]
    for n in dict.fromkeys(r["concurrency"] for r in rows):
        cells = []
        for a, s in cols:
            r = by.get((n, a, s))
            if r is None:
                cells.append("")
            elif s == "standard":
                cells.append("" if r.get(agg) is None else f"{r[agg]:.1f}")
            else:
                cells.append("" if r.get(ratio) is None else f"{r[ratio]:.2f}")
        same = all(all(r["identical_to_solo"]) for r in rows if r["concurrency"] == n)
        lines.append(f"{n:>3} " + "".join(f"{c:<{width}}" for c in cells) + ("all" if same else "NOT ALL"))
    return "\n".join(lines)
