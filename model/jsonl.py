"""Reading JSONL data files (training rows, evaluation problems) with errors that say where.

Every problem names the file, the line and, where it has one, the column: a byte that is not UTF-8
(``data.jsonl:3:17: not UTF-8 text (byte 0x8c)``), a line that is not JSON (``data.jsonl:5:57:
not valid JSON (Expecting ',' delimiter)``), a binary file. Blank lines are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from .errors import DataError


def read_jsonl_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, row)`` for each non-blank line of a JSONL file; ``where`` is ``"path:line"``.

    Raises:
        DataError: a missing file, or (when reached) a line that is not UTF-8 or not JSON, naming
            ``path:line:column``.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such data file.")
    with p.open("rb") as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip(b"\r\n")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{p}:{n}:{e.start + 1}: not UTF-8 text (byte 0x{line[e.start]:02x}); is this "
                                "a JSONL file? Each line must be one JSON object in UTF-8.") from None
            if n == 1:
                text = text.removeprefix("\ufeff")  # a byte-order mark is not part of the JSON
            if not text.strip():
                continue
            if "\x00" in text:
                raise DataError(f"{p}:{n}:{text.index(chr(0)) + 1}: a NUL character; this looks like a binary "
                                "file, not JSONL.")
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{n}:{e.colno}: not valid JSON ({e.msg}).") from None
            yield f"{p}:{n}", row
