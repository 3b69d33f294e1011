"""General instructions the aligned model writes itself (Magpie, arXiv 2406.08464), for self-distillation.

An instruction-tuned model given only its chat template up to the start of a user turn
(:func:`model.engine.text.user_turn_prefix_ids`) continues it with a user request of its own. Sampled
(temperature 1.0, top-p 0.95 by default: greedy decoding would write one instruction), filtered and
deduplicated, those requests are a general instruction set drawn from the model's own distribution; its
greedy answers (:mod:`model.training.self_answers`) are then exactly the text decoding sees, which is what
self-distillation trains on (the authors' checkpoints were trained on Magpie data: paper 4.1).

Three steps, each a CLI subcommand of ``python -m model.magpie``:

1. ``instructions``: sample, filter (:func:`instruction_problem`), deduplicate (:class:`NearDuplicates`),
   split off a held-out set that training never sees; resumable (rows are appended batch by batch, each
   batch drawn from its own seed).
2. answers: ``python -m model.self_answers --data INSTRUCTIONS`` (greedy, the adapter off).
3. ``mix``: drop degenerate answers (:func:`answer_problem`) and mix answer files by share into one
   shuffled training file.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..engine.loaded_model import LoadedModel
from ..engine.text import user_turn_prefix_ids
from ..errors import DataError
from ..jsonl import read_jsonl_rows

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?", re.UNICODE)
_MARKUP = ("<|", "|>", "<s>", "</s>", "[INST]", "im_start", "im_end")
_ROLE_LINE = re.compile(r"^\s*(user|assistant|system|human|ai)\s*[:\n]", re.IGNORECASE | re.MULTILINE)


def words(text: str) -> list[str]:
    """Lower-case words of ``text`` (letters and digits; an inner apostrophe kept)."""
    return [w.lower() for w in _WORD.findall(text)]


def repeated_ngram_share(tokens: Sequence[str], n: int) -> float:
    """Share of ``tokens`` covered by n-grams that occur more than once (0 for fewer than ``2 n`` tokens): a
    loop ("the sky is blue, the sky is blue, ...") scores near 1, ordinary prose near 0."""
    if len(tokens) < 2 * n:
        return 0.0
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    counts = Counter(grams)
    covered = [False] * len(tokens)
    for i, g in enumerate(grams):
        if counts[g] > 1:
            for j in range(i, i + n):
                covered[j] = True
    return sum(covered) / len(tokens)


@dataclass(frozen=True)
class InstructionLimits:
    """Bounds an instruction must meet (characters, words, looping share, letters share)."""

    min_chars: int = 12
    max_chars: int = 600
    min_words: int = 3
    max_words: int = 120
    max_repeated_share: float = 0.3  # of words covered by a 3-gram seen twice
    min_letter_share: float = 0.6


def instruction_problem(text: str, limits: InstructionLimits = InstructionLimits()) -> str | None:
    """Why a sampled user turn is no usable instruction, or None when it is.

    Reasons: ``empty``, ``too short`` / ``too long`` (characters or words), ``markup`` (chat markup or a
    role line: the model wrote a transcript, not a request), ``looping`` (repeated 3-grams cover more than
    ``max_repeated_share`` of its words), ``not text`` (few letters).
    """
    t = text.strip()
    if not t:
        return "empty"
    w = words(t)
    if len(t) < limits.min_chars or len(w) < limits.min_words:
        return "too short"
    if len(t) > limits.max_chars or len(w) > limits.max_words:
        return "too long"
    if any(m in t for m in _MARKUP) or _ROLE_LINE.search(t):
        return "markup"
    if repeated_ngram_share(w, 3) > limits.max_repeated_share:
        return "looping"
    if sum(c.isalpha() for c in t) < limits.min_letter_share * sum(not c.isspace() for c in t):
        return "not text"
    return None


def answer_problem(text: str, *, max_repeated_share: float = 0.5, n: int = 12) -> str | None:
    """Why a greedy answer should not be trained on, or None: ``empty``, or ``looping`` (word ``n``-grams seen
    twice cover more than ``max_repeated_share`` of it: a paragraph said again and again). A small model's
    greedy text is formulaic ("The discounted cost is ... The discounted cost is $25."): short repeats are what
    decoding will see and stay; 12-grams repeated over half the answer dropped ~12% of SmolLM2-135M's GSM8K
    answers and ~15% of its general ones, 4-grams half of them."""
    w = words(text)
    if not w:
        return "empty"
    if repeated_ngram_share(w, n) > max_repeated_share:
        return "looping"
    return None


def _normal(text: str) -> str:
    return " ".join(words(text))


class NearDuplicates:
    """Near-duplicate detection over word 3-grams (Jaccard similarity), with an inverted index so that a
    new text is compared only with the kept texts it shares a 3-gram with.

    Args:
        threshold: texts whose 3-gram sets have Jaccard similarity ≥ this are duplicates; the same words
            in the same order (case and punctuation aside) always are.
    """

    def __init__(self, threshold: float = 0.7) -> None:
        self.threshold = threshold
        self._exact: set[str] = set()
        self._grams: list[frozenset] = []
        self._index: dict[tuple, list[int]] = {}

    @staticmethod
    def _shingles(text: str) -> frozenset:
        w = words(text)
        return frozenset(tuple(w[i:i + 3]) for i in range(max(1, len(w) - 2)))

    def is_duplicate(self, text: str) -> bool:
        """True when ``text`` (near-)duplicates one added before."""
        if _normal(text) in self._exact:
            return True
        s = self._shingles(text)
        seen: Counter = Counter()
        for g in s:
            for j in self._index.get(g, ()):
                seen[j] += 1
        for j, shared in seen.items():
            if shared / (len(s) + len(self._grams[j]) - shared) >= self.threshold:
                return True
        return False

    def add(self, text: str) -> None:
        """Remember ``text`` as kept."""
        self._exact.add(_normal(text))
        s = self._shingles(text)
        j = len(self._grams)
        self._grams.append(s)
        for g in s:
            self._index.setdefault(g, []).append(j)


def sample_user_turns(lm: LoadedModel, count: int, *, seed: int, max_new_tokens: int = 96,
                      temperature: float = 1.0, top_p: float = 0.95) -> list[tuple[str, bool]]:
    """``count`` user turns sampled from the bare user-turn prefix, in one batched ``generate`` call with the
    adapter off (the base model: the teacher's own distribution); ``torch.manual_seed(seed)`` first, so a
    batch is reproducible on the same machine.

    Returns:
        ``(text, ended)`` per sample: the decoded turn (special tokens dropped) and whether it ended with a
        stop token (a turn still running at ``max_new_tokens`` is incomplete).

    Raises:
        ValueError: the model has no chat template.
    """
    prefix = user_turn_prefix_ids(lm.tokenizer)
    ids = torch.tensor([prefix] * count, dtype=torch.long, device=lm.device)
    stops = set(lm.stop_token_ids)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else (lm.stop_token_ids or (0,))[0]
    torch.manual_seed(seed)
    with torch.inference_mode(), lm.base_model() as model:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                             eos_token_id=list(lm.stop_token_ids) or None, pad_token_id=pad,
                             suppress_tokens=[lm.mask_token_id])
    turns = []
    for row in out[:, len(prefix):].tolist():
        end = next((i for i, t in enumerate(row) if t in stops), None)
        body = row if end is None else row[:end]
        turns.append((lm.tokenizer.decode(body, skip_special_tokens=True).strip(), end is not None))
    return turns


def heldout_bucket(text: str, share: float) -> bool:
    """Whether an instruction belongs to the held-out split: a stable hash of its normalised words, so the
    split does not depend on the order or the batch it was drawn in."""
    import hashlib

    h = int.from_bytes(hashlib.sha256(_normal(text).encode("utf-8")).digest()[:8], "big")
    return h / 2 ** 64 < share


def _rows(path: Path) -> list[dict]:
    return [row for _, row in read_jsonl_rows(path)] if path.is_file() and path.stat().st_size else []


def heldout_path(out: str | Path) -> Path:
    """Where the held-out split of ``out`` goes: ``name.heldout.jsonl`` beside it."""
    out = Path(out)
    return out.with_name(out.name.removesuffix(".jsonl") + ".heldout.jsonl")


def write_instructions(lm: LoadedModel, out: str | Path, count: int, *, heldout_share: float = 0.05,
                       batch_size: int = 64, seed: int = 0, max_new_tokens: int = 96, temperature: float = 1.0,
                       top_p: float = 0.95, limits: InstructionLimits = InstructionLimits(),
                       dedup_threshold: float = 0.7, show_progress: bool = True) -> dict[str, int]:
    """Sample instructions until ``count`` are kept (training and held-out together), appending rows
    ``{"index", "prompt", "batch", "generated_by"}`` to ``out`` (training) or :func:`heldout_path` (held out).

    Resumable: the rows already in both files are read back (into the deduplicator too) and sampling goes on
    with the next batch's seed (``seed * 1_000_003 + batch``).

    Returns:
        Counts: ``kept``, ``heldout``, ``sampled`` (this call) and one per rejection reason (``incomplete``
        for a turn cut at ``max_new_tokens``, ``duplicate``, and :func:`instruction_problem`'s reasons).

    Raises:
        ValueError: no chat template; ``count`` < 1.
    """
    from tqdm.auto import tqdm

    if count < 1:
        raise ValueError("count must be ≥ 1.")
    out, held = Path(out), heldout_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = _rows(out) + _rows(held)
    dedup = NearDuplicates(dedup_threshold)
    for r in rows:
        dedup.add(r["prompt"])
    stats: Counter = Counter(kept=len(rows), heldout=len(_rows(held)), sampled=0)
    batch = 1 + max((r["batch"] for r in rows), default=-1)
    bar = tqdm(total=count, initial=min(len(rows), count), desc="instructions", unit="instruction",
               disable=not show_progress, dynamic_ncols=True)
    with out.open("a", encoding="utf-8") as f_train, held.open("a", encoding="utf-8") as f_held:
        while stats["kept"] < count:
            for text, ended in sample_user_turns(lm, batch_size, seed=seed * 1_000_003 + batch,
                                                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p):
                stats["sampled"] += 1
                why = "incomplete" if not ended else instruction_problem(text, limits)
                if why is None and dedup.is_duplicate(text):
                    why = "duplicate"
                if why is not None:
                    stats[why] += 1
                    continue
                if stats["kept"] >= count:
                    break
                dedup.add(text)
                is_held = heldout_bucket(text, heldout_share)
                row = {"index": stats["kept"], "prompt": text, "batch": batch, "generated_by": lm.source}
                (f_held if is_held else f_train).write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
                stats["kept"] += 1
                stats["heldout"] += is_held
                bar.update(1)
            f_train.flush()
            f_held.flush()
            batch += 1
    bar.close()
    return dict(stats)


def mix(sources: Sequence[tuple[str | Path, float]], out: str | Path, *, total: int | None = None,
        seed: int = 0) -> dict[str, dict[str, int]]:
    """One shuffled training file from answer files (``model.self_answers`` rows) mixed by share.

    Rows with a degenerate answer (:func:`answer_problem`) are dropped first. With ``total`` unset, the
    largest total the shares allow without repeating a row is used; a source asked for more rows than it
    has repeats them (said in the counts).

    Args:
        sources: ``(path, share)`` pairs; the shares are normalised.

    Returns:
        Per source: ``read``, ``kept`` (after the filter), ``used`` (in the output, repeats counted) and one
        count per rejection reason.

    Raises:
        DataError: a source without usable rows; shares not positive.
    """
    if not sources or any(s <= 0 for _, s in sources):
        raise DataError("mix: every source needs a share > 0.")
    rng = random.Random(seed)
    kept: list[list[dict]] = []
    report: dict[str, dict[str, int]] = {}
    for path, _ in sources:
        rows = _rows(Path(path))
        c: Counter = Counter(read=len(rows))
        ok = []
        for r in rows:
            why = answer_problem(r.get("response", ""))
            if why:
                c[why] += 1
            else:
                ok.append(r)
        if not ok:
            raise DataError(f"{path}: no usable answers to mix (read {len(rows)}).")
        c["kept"] = len(ok)
        kept.append(ok)
        report[str(path)] = c
    weight = sum(s for _, s in sources)
    shares = [s / weight for _, s in sources]
    if total is None:
        total = int(min(len(k) / s for k, s in zip(kept, shares)))
    mixed: list[dict] = []
    for (path, _), ok, share in zip(sources, kept, shares):
        n = round(total * share)
        pick = [ok[i % len(ok)] for i in range(n)] if n > len(ok) else rng.sample(ok, n)
        mixed += [{**r, "source": Path(path).name} for r in pick]
        report[str(path)]["used"] = n
    rng.shuffle(mixed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in mixed), encoding="utf-8")
    return {k: dict(v) for k, v in report.items()}

