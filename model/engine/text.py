"""Where tokens meet text: prompts that keep untrusted text literal, the bytes behind each token,
and the state of an open UTF-8 character.

User and model text is content, never markup: a message that spells ``<|im_end|>`` or the mask
token must become the tokens of those characters, not the special token (else a user could forge an
assistant turn or put a mask token into the KV cache). Only the chat template's own markup becomes
special tokens (:func:`chat_prompt_ids`, :func:`encode_literal`).

Byte-level vocabularies (GPT-2 style BPE as in SmolLM2, Llama 3, Qwen; SentencePiece with byte
fallback as in Llama 2) can split one multi-byte character over several tokens. A block of
proposals that keeps the first bytes of a character and then a token that cannot continue it
would leave a broken character (U+FFFD) in the answer, so the decoder ends a block there
(:func:`continues_utf8`), and the answer text never shows an incomplete last character
(:func:`open_utf8_bytes`).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Iterable

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SLOT = "\ue000{}\ue001"  # a placeholder for message i while the template renders (private-use characters)


def encode_literal(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` taken literally: a substring that spells a special token is tokenised as
    the characters it is made of (``split_special_tokens``); no BOS/EOS added."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def chat_prompt_ids(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """A chat rendered with the tokenizer's template, each message's content taken literally.

    The template renders placeholders instead of the contents. The special tokens in that render are
    the template's own markup and become special-token ids; the text between them, with the contents
    put back, is tokenised with :func:`encode_literal`. For ordinary text the ids equal tokenising the
    fully rendered chat (tested); a content that spells a special token keeps its characters.

    Args:
        messages: ``[{"role": ..., "content": str}, ...]``.

    Returns:
        The prompt's token ids.

    Raises:
        ValueError: the template drops, repeats or rewrites a message's content (it cannot be kept
            literal), or a content holds the placeholder character U+E000.
    """
    contents = [str(m.get("content", "")) for m in messages]
    if any("\ue000" in c for c in contents):
        raise ValueError("Message text may not contain the private-use character U+E000.")
    slots = [_SLOT.format(i) for i in range(len(messages))]
    rendered = tokenizer.apply_chat_template([{**m, "content": slot} for m, slot in zip(messages, slots)],
                                             tokenize=False, add_generation_prompt=add_generation_prompt)
    if any(rendered.count(slot) != 1 for slot in slots):
        raise ValueError("This model's chat template drops or rewrites message text, so it cannot be kept literal.")
    return _template_ids(tokenizer, rendered, dict(zip(slots, contents)))


def _template_ids(tokenizer: Any, rendered: str, fill: dict[str, str]) -> list[int]:
    """Ids of a template's render: its special-token markup as special ids, the text between with each
    placeholder of ``fill`` replaced by its content, tokenised literally."""
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, specials)) + ")", rendered) if specials else [rendered]:
        if piece in specials:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            for slot, content in fill.items():
                piece = piece.replace(slot, content)
            ids += encode_literal(tokenizer, piece)
    return ids


def user_turn_prefix_ids(tokenizer: Any) -> list[int]:
    """The chat template rendered up to where a user's first message begins (system prompt included when
    the template adds a default one), e.g. ``<|im_start|>system\n...<|im_end|>\n<|im_start|>user\n`` for
    SmolLM2: what an aligned model continues with a user request of its own (Magpie, arXiv 2406.08464).

    Raises:
        ValueError: the tokenizer has no chat template, or its template does not render a user message's
            text once.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("This tokenizer has no chat template: there is no user-turn prefix to continue.")
    slot = _SLOT.format(0)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": slot}], tokenize=False,
                                             add_generation_prompt=False)
    if rendered.count(slot) != 1:
        raise ValueError("This model's chat template drops or rewrites message text: no user-turn prefix.")
    return _template_ids(tokenizer, rendered.split(slot)[0], {})


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


class TokenBytes:
    """The UTF-8 bytes each token id stands for, computed on first use and cached.

    Special tokens (EOS, the mask token, chat markup) stand for no text bytes: ``b""``.

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._special |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()
                          if getattr(t, "special", False)}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        """The bytes of one token."""
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._compute(int(token_id))
        return b

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._special:
            return b""
        piece = self._tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        m = _BYTE_FALLBACK.match(piece)
        if m:  # SentencePiece byte fallback
            return bytes([int(m.group(1), 16)])
        dec = _byte_decoder()
        if all(ch in dec for ch in piece):  # GPT-2 style byte-level BPE
            return bytes(dec[ch] for ch in piece)
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece word piece


def _char_length(lead: int) -> int:
    """Bytes of a UTF-8 character starting with byte ``lead`` (0: not a lead byte)."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def open_utf8_bytes(data: bytes) -> int:
    """Continuation bytes still needed to finish the last character of ``data`` (0: complete)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if 0x80 <= b <= 0xBF:
            continue
        n = _char_length(b)
        return max(0, n - back) if n else 0
    return 0


def continues_utf8(open_bytes: int, token: bytes) -> bool:
    """True when ``token`` may follow text whose last character lacks ``open_bytes`` bytes:
    with a character open it must start with continuation bytes; with none open it must not."""
    if not token:
        return open_bytes == 0
    need = min(open_bytes, len(token))
    head = token[:need]
    if any(not 0x80 <= b <= 0xBF for b in head):
        return False
    return open_bytes > 0 or not 0x80 <= token[0] <= 0xBF


def text_bytes(token_bytes: TokenBytes, ids: Iterable[int]) -> bytes:
    """The bytes of a sequence of tokens."""
    return b"".join(token_bytes(t) for t in ids)
