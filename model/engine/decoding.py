"""MTP decoding, one forward pass at a time (paper 3.4 and 4.5).

A forward pass feeds, at ordinary consecutive positions with plain causal attention,

    pending real tokens  +  drafts  +  (k_max - 1) mask tokens

* **pending**: the tokens emitted but not yet in the KV cache (the prompt on the first pass);
* **drafts** (only :class:`~model.engine.strategies.Verify`): the previous pass's mask proposals, fed as
  real tokens so that this pass's logits check them;
* **masks**: the mask token, whose logits propose the tokens after the last real one.

:meth:`Decoder.run_pass` runs one forward pass through four phases, each a function below:

1. **propose** (:func:`propose`): greedy token and confidence (top-1 probability, float32, the
   mask token excluded) at the last pending token, at each draft and at each mask;
2. **accept** (:func:`accept`): block strategies keep a leading run of the block ``[greedy at the
   last real token, mask proposals...]`` (:meth:`Strategy.accept`), cut where a proposal cannot
   continue an open UTF-8 character (:func:`cut_broken_utf8`); verification keeps the drafts equal
   to the model's greedy choice, then the model's own next token (:func:`accept_drafts`);
3. **trim** (:func:`trim`): up to and including the first stop token, never past ``max_new_tokens``;
4. **commit** (:func:`commit`): crop the KV cache back to the real tokens that stay valid (never a
   mask, never a rejected draft); the decoder then records the pass in a :class:`PassRecord`.

Invariant after every pass: the cache holds exactly ``cached_ids`` and ``cached_ids + pending ==
prompt + generated``. The app, the evaluation and the benchmark consume pass records only.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import torch

from ..errors import ContextBudgetError, NonFiniteLogitsError
from .loaded_model import LoadedModel
from .strategies import Strategy, check_max_new_tokens
from .text import continues_utf8, open_utf8_bytes, text_bytes


# --------------------------------------------------------------------------- records
@dataclass
class PassRecord:
    """What one forward pass did (the record the app, evaluation and benchmarks consume).

    Attributes:
        index: 0-based number of the forward pass (pass 0 is the prefill).
        fed_real: pending real tokens fed (the prompt on pass 0, then the previous pass's last
            token(s) not yet in the KV cache).
        fed_drafts: draft tokens fed as real tokens (verification only; else 0).
        fed_masks: mask tokens fed (``k_max - 1``; 0 for standard decoding).
        proposals: ``k_max`` greedy token ids: at the last real token fed, then one per mask.
        proposal_texts: each proposal decoded on its own.
        confidences: ``k_max`` top-1 probabilities (float32 softmax over the vocabulary, the mask
            token excluded), one per proposal.
        kept: token ids this pass emitted (after UTF-8, stop-token and max_new_tokens trimming).
        text: the text this pass added to the answer (an incomplete last character is held back).
        accepted: tokens the strategy accepted before stop-token / max_new_tokens trimming.
        seconds: wall-clock seconds of the pass (forward, proposals, cache crop; device synchronised).
        stopped: True if this pass emitted a stop token.
        block_end: why the block ended: ``"k_max"`` (every proposal kept), ``"below tau"``,
            ``"utf-8"`` (the next proposal could not continue an open character), ``"draft
            rejected"``, ``"stop token"`` or ``"max_new_tokens"``.
        drafts: the draft ids fed (verification), in order.
        draft_texts: each draft decoded on its own.
        draft_checks: the model's greedy token at each draft's place (``len(drafts)`` ids).
        draft_confidences: the model's top-1 probability at each draft's place.
        drafts_accepted: leading drafts equal to ``draft_checks``.
        correction: the model's token in place of the first rejected draft (None if none rejected).
        correction_text: that token decoded on its own ("" when none).
    """

    index: int
    fed_real: int
    fed_masks: int
    proposals: list[int]
    proposal_texts: list[str]
    confidences: list[float]
    kept: list[int]
    text: str
    accepted: int
    seconds: float
    stopped: bool = False
    block_end: str = "k_max"
    fed_drafts: int = 0
    drafts: list[int] = field(default_factory=list)
    draft_texts: list[str] = field(default_factory=list)
    draft_checks: list[int] = field(default_factory=list)
    draft_confidences: list[float] = field(default_factory=list)
    drafts_accepted: int = 0
    correction: int | None = None
    correction_text: str = ""

    @property
    def fed_tokens(self) -> int:
        """All tokens fed to this forward pass (pending + drafts + masks)."""
        return self.fed_real + self.fed_drafts + self.fed_masks

    def to_dict(self) -> dict:
        """JSON-ready dict (includes ``fed_tokens``)."""
        d = asdict(self)
        d["fed_tokens"] = self.fed_tokens
        return d


@dataclass
class GenerationResult:
    """Totals of one generation.

    Attributes:
        text: the answer (special tokens skipped, no incomplete last character).
        token_ids: the generated ids (the stop token included if one was emitted).
        passes: one :class:`PassRecord` per forward pass.
        strategy: the strategy's spec string.
    """

    text: str
    token_ids: list[int]
    passes: list[PassRecord] = field(default_factory=list)
    strategy: str = "standard"

    @property
    def new_tokens(self) -> int:
        """Tokens generated."""
        return len(self.token_ids)

    @property
    def forward_passes(self) -> int:
        """Forward passes run (prefill included)."""
        return len(self.passes)

    @property
    def effective_k(self) -> float:
        """Tokens per forward pass (the paper's acceleration measure)."""
        return self.new_tokens / self.forward_passes if self.passes else 0.0

    @property
    def seconds(self) -> float:
        """Sum of the passes' own seconds."""
        return sum(p.seconds for p in self.passes)

    @property
    def tokens_per_second(self) -> float:
        """new_tokens / seconds (0 before any pass)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        """The CLI's ``--json`` object (strict JSON: no NaN)."""
        return {
            "strategy": self.strategy, "text": self.text, "new_tokens": self.new_tokens,
            "forward_passes": self.forward_passes, "effective_k": self.effective_k, "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second, "passes": [p.to_dict() for p in self.passes],
        }


# --------------------------------------------------------------------------- phases
def check_context_budget(lm: LoadedModel, prompt_len: int, max_new_tokens: int, strategy: Strategy) -> None:
    """Refuse a generation whose positions could run past the model's ``max_position_embeddings``.

    The budget is ``prompt_len + max_new_tokens + strategy.lookahead`` positions (the look-ahead is
    the drafts and mask tokens a pass feeds after the last emitted token).

    Raises:
        ContextBudgetError: over the limit, naming the limit and each part.
    """
    limit = lm.max_positions
    need = prompt_len + max_new_tokens + strategy.lookahead
    if limit is not None and need > limit:
        raise ContextBudgetError(
            f"The prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + {strategy.lookahead} "
            f"look-ahead positions of {strategy.label} = {need} positions, more than this model's "
            f"{limit} (max_position_embeddings). Shorten the prompt or lower max_new_tokens.")


def propose(logits: torch.Tensor, mask_token_id: int) -> tuple[list[int], list[float]]:
    """Greedy proposals and their confidences for each position of one pass.

    Args:
        logits: ``[T, V]`` logits (any float dtype) at the positions that propose.
        mask_token_id: never proposed.

    Returns:
        ``(tokens, confidences)``: ``T`` greedy ids and their top-1 probabilities (float32 softmax
        over the vocabulary without the mask token).

    Raises:
        NonFiniteLogitsError: a NaN or infinite logit (the softmax would be meaningless).
    """
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        bad = (~torch.isfinite(logits)).any(-1).nonzero().flatten().tolist()
        raise NonFiniteLogitsError(
            f"The forward pass produced NaN or infinite logits at {len(bad)} of {logits.shape[0]} positions; "
            "no token can be chosen. The weights or the dtype cannot represent this computation "
            "(e.g. float16 on a CPU); load the model in float32 or bfloat16.")
    logits[:, mask_token_id] = float("-inf")
    conf, tokens = torch.softmax(logits, dim=-1).max(dim=-1)
    return tokens.tolist(), conf.tolist()


def accept_drafts(drafts: Sequence[int], checks: Sequence[int]) -> int:
    """Leading drafts equal to the model's greedy choice at their place (lossless verification)."""
    n = 0
    while n < len(drafts) and drafts[n] == checks[n]:
        n += 1
    return n


def cut_broken_utf8(lm: LoadedModel, generated: Sequence[int], block: Sequence[int], n: int) -> int:
    """Shorten a kept block so that no proposal after the first breaks an open UTF-8 character.

    Args:
        generated: the tokens emitted before this block.
        block: the block's proposals; the first ``n`` are kept by the strategy.

    Returns:
        The new ``n`` (≥ 1: the first proposal is the model's own next token and always stays).
    """
    data = text_bytes(lm.token_bytes, list(generated[-4:]) + [block[0]])  # the last character starts in there
    for i in range(1, n):
        b = lm.token_bytes(block[i])
        if not continues_utf8(open_utf8_bytes(data), b):
            return i
        data += b
    return n


@dataclass
class Acceptance:
    """What the accept phase decided for one pass.

    Attributes:
        kept: the tokens to emit, before trimming.
        reason: why the block ends (see :attr:`PassRecord.block_end`).
        drafts_accepted: leading drafts equal to the model's own choice (verification; else 0).
        correction: the model's token in place of the first rejected draft, or None.
        next_drafts: the drafts the next pass feeds (verification; else empty).
    """

    kept: list[int]
    reason: str
    drafts_accepted: int = 0
    correction: int | None = None
    next_drafts: list[int] = field(default_factory=list)


def accept(lm: LoadedModel, strategy: Strategy, generated: Sequence[int], drafts: Sequence[int],
           checks: Sequence[int], block: Sequence[int], block_conf: Sequence[float]) -> Acceptance:
    """The accept phase: which of a pass's proposals become output.

    Args:
        generated: tokens emitted before this pass.
        drafts: the drafts this pass fed (verification); ``checks``: the model's greedy token at each.
        block: ``k_max`` proposals (at the last real token, then one per mask); ``block_conf``: their
            confidences.
    """
    if strategy.verifies:
        a = accept_drafts(drafts, checks)
        kept = list(drafts[:a]) + [(list(checks) + list(block))[a]]
        rejected = a < len(drafts)
        return Acceptance(kept, "draft rejected" if rejected else "k_max", a, checks[a] if rejected else None,
                          [] if rejected else list(block[1:]))
    n, reason = strategy.accept(block_conf)
    cut = cut_broken_utf8(lm, generated, block, n)
    if cut < n:
        n, reason = cut, "utf-8"
    return Acceptance(list(block[:n]), reason)


def trim(kept: Sequence[int], reason: str, room: int, stop_ids: set[int]) -> tuple[list[int], str, bool]:
    """The trim phase: the kept tokens up to and including the first stop token, at most ``room``
    (``max_new_tokens`` is exact). Returns ``(kept, reason, stopped)``."""
    kept = list(kept)
    if len(kept) > room:
        kept, reason = kept[:room], "max_new_tokens"
    for i, t in enumerate(kept):
        if t in stop_ids:
            return kept[: i + 1], "stop token", True
    return kept, reason, False


def commit(cache: Any, fed: int, pending: int, kept: Sequence[int], verifies: bool) -> list[int]:
    """The commit phase: crop the KV cache back to the entries that stay valid — the pending tokens and,
    when verifying, the drafts that were kept (their entries are already right) — and return the kept
    tokens whose entries stay in the cache. Never a mask entry, never a rejected draft's.

    Args:
        cache: the pass's KV cache (``crop(-n)`` drops the last ``n`` entries).
        fed: tokens the pass fed; ``pending``: of which pending real tokens (first in the pass).
    """
    in_cache = list(kept[:-1]) if verifies else []
    drop = fed - pending - len(in_cache)
    if drop:
        cache.crop(-drop)
    return in_cache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- decoder
class Decoder:
    """Iterator over the forward passes of one generation (batch size 1).

    Usage::

        dec = Decoder(lm, lm.prompt_ids("What is 2+2?"), confadapt(0.9, 16), max_new_tokens=128)
        for record in dec:   # one PassRecord per forward pass
            print(record.text, end="")
        dec.result()         # GenerationResult

    Args:
        lm: the loaded model.
        prompt_ids: the prompt, ``prompt_len`` token ids (``lm.prompt_ids(...)``).
        strategy: from :mod:`model.engine.strategies`.
        max_new_tokens: exact upper bound on generated tokens.

    Raises (at construction):
        ValueError: empty prompt, bad max_new_tokens.
        ContextBudgetError: prompt + max_new_tokens + look-ahead beyond the model's positions.
    """

    def __init__(self, lm: LoadedModel, prompt_ids: Sequence[int], strategy: Strategy, max_new_tokens: int = 128):
        if len(prompt_ids) == 0:
            raise ValueError("The prompt is empty: nothing to condition on.")
        self.lm = lm
        self.strategy = strategy
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        self.prompt_ids = [int(t) for t in prompt_ids]
        check_context_budget(lm, len(self.prompt_ids), self.max_new_tokens, strategy)
        self.cache = lm.new_cache()
        self.cached_ids: list[int] = []
        self.pending: list[int] = list(self.prompt_ids)
        self.drafts: list[int] = []
        self.generated: list[int] = []
        self.passes: list[PassRecord] = []
        self.done = False
        self._text = ""
        self._stop = set(lm.stop_token_ids)

    def __iter__(self) -> Iterator[PassRecord]:
        while not self.done:
            yield self.run_pass()

    @torch.inference_mode()
    def run_pass(self) -> PassRecord:
        """Run one forward pass (propose, accept, trim, commit) and return its record.

        Raises:
            StopIteration: the generation is done.
            NonFiniteLogitsError: the pass produced NaN / infinite logits (the decoder stops).
        """
        if self.done:
            raise StopIteration
        lm, s, drafts = self.lm, self.strategy, self.drafts
        fed = self.pending + drafts + [lm.mask_token_id] * s.num_masks
        _sync(lm.device)
        t0 = time.perf_counter()
        ids = torch.tensor([fed], dtype=torch.long, device=lm.device)
        logits = lm.forward(ids, self.cache, num_masks=s.num_masks, logits_to_keep=len(drafts) + s.k_max)[0]
        try:
            greedy, conf = propose(logits, lm.mask_token_id)
        except NonFiniteLogitsError:
            self.done = True
            raise
        checks, block, block_conf = greedy[: len(drafts)], greedy[len(drafts):], conf[len(drafts):]
        acc = accept(lm, s, self.generated, drafts, checks, block, block_conf)
        kept, reason, stopped = trim(acc.kept, acc.reason, self.max_new_tokens - len(self.generated), self._stop)
        in_cache = commit(self.cache, len(fed), len(self.pending), kept, s.verifies)
        _sync(lm.device)
        seconds = time.perf_counter() - t0

        self.cached_ids.extend(self.pending + in_cache)
        self.generated.extend(kept)
        self.pending = kept[-1:] if s.verifies else kept
        self.drafts = acc.next_drafts
        self.done = stopped or len(self.generated) >= self.max_new_tokens
        decode = lm.tokenizer.decode
        rec = PassRecord(
            index=len(self.passes), fed_real=len(fed) - len(drafts) - s.num_masks, fed_masks=s.num_masks,
            proposals=block, proposal_texts=[decode([t]) for t in block], confidences=block_conf, kept=kept,
            text=self._text_delta(), accepted=len(acc.kept), seconds=seconds, stopped=stopped, block_end=reason,
            fed_drafts=len(drafts), drafts=list(drafts), draft_texts=[decode([t]) for t in drafts],
            draft_checks=checks, draft_confidences=conf[: len(drafts)], drafts_accepted=acc.drafts_accepted,
            correction=acc.correction, correction_text=decode([acc.correction]) if acc.correction is not None else "",
        )
        self.passes.append(rec)
        return rec

    def _text_delta(self) -> str:
        """The text added since the last pass; an incomplete last character is held back (and dropped
        at the end of the answer: never shown as U+FFFD)."""
        text = self.lm.tokenizer.decode(self.generated, skip_special_tokens=True)
        if open_utf8_bytes(text_bytes(self.lm.token_bytes, self.generated[-4:])) and text.endswith("\ufffd"):
            text = text[:-1]
        delta = text[len(self._text):] if text.startswith(self._text) else text
        self._text = text
        return delta

    def result(self) -> GenerationResult:
        """Totals so far (complete once iteration has ended)."""
        return GenerationResult(text=self._text, token_ids=list(self.generated), passes=list(self.passes),
                                strategy=self.strategy.spec)


def run(lm: LoadedModel, prompt_ids: Sequence[int], strategy: Strategy, max_new_tokens: int = 128) -> GenerationResult:
    """Decode to the end from prompt ids and return the totals.

    Raises:
        ValueError, ContextBudgetError: as :class:`Decoder`.
        NonFiniteLogitsError: a pass produced NaN / infinite logits.
    """
    dec = Decoder(lm, prompt_ids, strategy, max_new_tokens)
    for _ in dec:
        pass
    return dec.result()


def generate(
    lm: LoadedModel, prompt: str | Sequence[dict], strategy: Strategy, max_new_tokens: int = 128
) -> GenerationResult:
    """Run one generation from a user message or a messages-format chat history.

    Raises:
        ValueError: empty prompt, bad max_new_tokens; ContextBudgetError, NonFiniteLogitsError.
    """
    return run(lm, lm.prompt_ids(prompt), strategy, max_new_tokens)


def hf_generate(lm: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers ``generate`` greedy (``do_sample=False``), new ids only.

    Uses the same stop tokens (none: runs to ``max_new_tokens``); the mask token is suppressed as in
    our loop.
    """
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)
    stop = list(lm.stop_token_ids) or None
    pad = lm.tokenizer.pad_token_id
    if pad is None:
        pad = stop[0] if stop else 0
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=stop, pad_token_id=pad, suppress_tokens=[lm.mask_token_id], temperature=None, top_p=None,
            top_k=None,
        )
    return out[0, ids.shape[1]:].tolist()
