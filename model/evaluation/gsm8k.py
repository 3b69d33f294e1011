"""GSM8K: problems from JSONL, the prompt, the gold number after ``####`` and a flexible extractor for answers.

The flexible extractor follows lm-eval-harness's GSM8K "flexible-extract" idea (the last number in
the text) with a few safer rules for chatty instruct models:

1. an explicit final marker wins: the last number of the sentence (up to ". ", a newline or "}")
   that follows the *last* ``####``, "The answer is", "Answer:" or ``\\boxed{``;
2. otherwise the last number anywhere in the text.

Numbers are normalised before comparison: dollar signs, thousands commas and trailing periods
are dropped, ``12.00`` equals ``12`` and ``-3`` keeps its sign. Units after a number
("18 dollars", "5 km") are ignored because only the number is read.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

from ..errors import DataError
from ..jsonl import read_jsonl_rows

__all__ = ["STEP_BY_STEP", "load_problems", "make_prompt", "extract_gold", "extract_answer", "normalize_number",
           "is_correct"]

STEP_BY_STEP = "Let's think step by step."

# A number: optional sign, optional $, digits with optional thousands commas, optional decimals.
_NUM = r"-?\$?\s?\d+(?:,\d+)*(?:\.\d+)?|-?\$?\.\d+"
_NUM_RE = re.compile(_NUM)
_MARKERS = re.compile(
    r"(?:####|the\s+(?:final\s+)?answer\s+is\s*:?|final\s+answer\s*:|answer\s*:|\\boxed\{)",
    re.IGNORECASE,
)
_SENTENCE_END = re.compile(r"\.(?:\s|$)|\n|\}")


def normalize_number(text: str) -> str | None:
    """Canonical form of a number string (``"$1,234.50"`` -> ``"1234.5"``), None if not a number.

    Integral values lose their decimals (``"12.00"`` -> ``"12"``).
    """
    s = text.strip().replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    if not s:
        return None
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_gold(answer: str) -> str:
    """The gold number of a GSM8K ``answer`` field (the text after ``####``), normalised.

    Raises:
        ValueError: no ``####`` marker, or no number after it.
    """
    if "####" not in answer:
        raise ValueError("The answer has no '#### number' line (not GSM8K format).")
    tail = answer.rsplit("####", 1)[1]
    m = _NUM_RE.search(tail)
    value = normalize_number(m.group(0)) if m else None
    if value is None:
        raise ValueError(f"No number after '####' in the answer: {tail.strip()[:40]!r}.")
    return value


def extract_answer(text: str) -> str | None:
    """The number a model's answer gives (flexible extraction), normalised; None if none.

    Args:
        text: the generated answer.

    Returns:
        The last number in the sentence after the last answer marker ("####", "The answer is",
        "Answer:", "\\boxed{"), else the last number in the text; None when the text holds no
        number.
    """
    markers = list(_MARKERS.finditer(text))
    if markers:
        start = markers[-1].end()
        end = _SENTENCE_END.search(text, start)
        # the marker's sentence: its last number ("The answer is 24 * 5 = 120 minutes." -> 120)
        for m in reversed(list(_NUM_RE.finditer(text, start, end.start() if end else len(text)))):
            value = normalize_number(m.group(0))
            if value is not None:
                return value
    for m in reversed(list(_NUM_RE.finditer(text))):
        value = normalize_number(m.group(0))
        if value is not None:
            return value
    return None


def is_correct(extracted: str | None, gold: str) -> bool:
    """True when the extracted number equals the gold one (both normalised)."""
    return extracted is not None and normalize_number(extracted) == normalize_number(gold)


# --------------------------------------------------------------------------- problems
def load_problems(path: str | Path, limit: int | None = None, offset: int = 0) -> list[dict]:
    """Read GSM8K-format JSONL: one ``{"question": ..., "answer": "... #### 18"}`` per line.

    Args:
        path: the JSONL file.
        limit: keep only the first ``limit`` problems (None: all).
        offset: skip this many problems first (shards of one file: ``offset=100, limit=100``); every
            row is still checked.

    Returns:
        ``[{"index", "question", "answer", "gold"}]`` with ``gold`` the normalised number and
        ``index`` the problem's 0-based position in the file (offset included).

    Raises:
        DataError: missing file, a line that is not UTF-8 or JSON, missing fields, an answer without
            ``#### number``, no problems (``file:line[:column]: reason``); ValueError: a bad limit or offset.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"--limit must be an integer ≥ 1, got {limit!r}.")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"--offset must be an integer ≥ 0, got {offset!r}.")
    problems: list[dict] = []
    seen = 0
    for where, row in read_jsonl_rows(path):
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(
                row.get("answer"), str):
            raise DataError(f"{where}: needs string fields 'question' and 'answer' (GSM8K format).")
        try:
            gold = extract_gold(row["answer"])
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        seen += 1
        if seen <= offset:
            continue
        problems.append({"index": seen - 1, "question": row["question"], "answer": row["answer"], "gold": gold})
        if limit is not None and len(problems) >= limit:
            break
    if not problems:
        raise DataError(f"{path} holds no problems" + (f" after the first {offset}." if offset else "."))
    return problems


def make_prompt(question: str, step_by_step: bool = False) -> str:
    """The user message for one problem: the question, optionally followed by "Let's think step by step."

    The model's own prompt format (chat template or ``bos + text + "\\n\\n"``) is applied by
    :meth:`LoadedModel.prompt_ids`.
    """
    return f"{question.strip()}\n{STEP_BY_STEP}" if step_by_step else question.strip()
