"""Each conversation's KV caches between its turns (prefix caching, as serving engines do; paper 3.4's decoding
loop is unchanged): a follow-up turn computes its own tokens only, not the whole conversation again.

After a turn ends (done or stopped), each side's decoder holds a KV cache of exactly its ``cached_ids``: the
prompt and the answer so far. The next turn's prompt starts with the same conversation (its earlier answer is the
standard one), so both sides reuse the longest prefix that *both* caches share with it: the two sides compute the
same suffix and their times still compare like with like. Caches live in this process only (a ZeroGPU worker
starts without them) and are bounded: :data:`MAX_CACHED_TOKENS` tokens in all, the least recently used session
dropped first. No Gradio type here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

#: Tokens of KV cache kept for all sessions together (SmolLM2-135M in bf16: ~23 KB a token, ~190 MB in all).
MAX_CACHED_TOKENS = 8192


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n


class PrefixStore:
    """The KV caches each session's last turn left, per model (module docstring).

    Args:
        max_tokens: tokens kept in all (each side's cache counts its tokens).
    """

    def __init__(self, max_tokens: int = MAX_CACHED_TOKENS):
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[tuple, dict[str, tuple[Any, list[int]]]]] = OrderedDict()

    def put(self, session: str | None, model_key: tuple, sides: dict[str, tuple[Any, Sequence[int]]]) -> None:
        """Keep ``sides`` (``{side: (cache, ids)}``, each cache holding exactly ``ids``) as ``session``'s caches
        for model ``model_key``, replacing what it had; the least recently used sessions go past the bound."""
        if session is None:
            return
        with self._lock:
            self._entries[session] = (tuple(model_key), {k: (c, list(ids)) for k, (c, ids) in sides.items()})
            self._entries.move_to_end(session)
            while self._entries and self.tokens_locked() > self.max_tokens:
                self._entries.popitem(last=False)

    def take(self, session: str | None, model_key: tuple, prompt_ids: Sequence[int], sides: Sequence[str]
             ) -> dict[str, tuple[Any, list[int]]]:
        """The caches to start ``session``'s next turn from, taken out of the store (a turn's decoders own and
        change them): for each side, its cache cropped to the prefix that every side's cache shares with
        ``prompt_ids`` (at most all but its last token); ``{}`` when there is none (another model, nothing kept,
        nothing in common)."""
        if session is None:
            return {}
        with self._lock:
            entry = self._entries.pop(session, None)
        if entry is None or entry[0] != tuple(model_key) or any(s not in entry[1] for s in sides):
            return {}
        caches = entry[1]
        n = min([common_prefix(caches[s][1], prompt_ids) for s in sides] + [len(prompt_ids) - 1])
        if n <= 0:
            return {}
        out = {}
        for s in sides:
            cache, ids = caches[s]
            if cache.get_seq_length() != len(ids):
                return {}
            if len(ids) > n:
                cache.crop(-(len(ids) - n))
            out[s] = (cache, ids[:n])
        return out

    def drop(self, session: str | None) -> None:
        """Forget ``session``'s caches (Clear)."""
        with self._lock:
            self._entries.pop(session, None)

    def tokens(self) -> int:
        """Tokens of KV cache kept in all."""
        with self._lock:
            return self.tokens_locked()

    def tokens_locked(self) -> int:
        """:meth:`tokens` with the lock held."""
        return sum(len(ids) for _, sides in self._entries.values() for _, ids in sides.values())
