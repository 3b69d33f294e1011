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
3. **trim** (:func:`trim`, :func:`cut_at_stop_string`): up to and including the first stop token (or
   the token that completes a stop string), never past ``max_new_tokens``;
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
from .sampling import GREEDY, Sampling, TokenSampler, draw_block, speculative_accept
from .strategies import Strategy, check_max_new_tokens
from .text import continues_utf8, open_utf8_bytes, text_bytes


# --------------------------------------------------------------------------- records
@dataclass
class PassRecord:
    """What one forward pass did (the record the app, evaluation and benchmarks consume).

    Attributes:
        index: 0-based number of the forward pass (pass 0 is the prefill).
        fed_real: pending real tokens fed (the prompt on pass 0, its chunks fed before included, less any
            prefix reused from an earlier generation's KV cache; then the previous pass's last token(s) not yet in
            the KV cache).
        fed_drafts: draft tokens fed as real tokens (verification only; else 0).
        fed_masks: mask tokens fed (``k_max - 1``; 0 for standard decoding).
        proposals: ``k_max`` greedy token ids: at the last real token fed, then one per mask (when
            sampling: the tokens drawn there).
        proposal_texts: each proposal decoded on its own.
        confidences: ``k_max`` top-1 probabilities (float32 softmax over the vocabulary, the mask
            token excluded), one per proposal (when sampling: each drawn token's probability under its
            position's sampling distribution, what ConfAdapt compares with tau).
        kept: token ids this pass emitted (after UTF-8, stop-token and max_new_tokens trimming).
        text: the text this pass added to the answer (an incomplete last character is held back).
        accepted: tokens the strategy accepted before stop-token / max_new_tokens trimming.
        seconds: wall-clock seconds of the pass (forward, proposals, cache crop; device synchronised).
        stopped: True if this pass emitted a stop token.
        block_end: why the block ended: ``"k_max"`` (every proposal kept), ``"below tau"``,
            ``"utf-8"`` (the next proposal could not continue an open character), ``"draft
            rejected"``, ``"stop token"``, ``"stop string"`` or ``"max_new_tokens"``.
        drafts: the draft ids fed (verification), in order.
        draft_texts: each draft decoded on its own.
        draft_checks: the model's greedy token at each draft's place (``len(drafts)`` ids; when sampling:
            the token it chose there: the draft if accepted, the replacement at the first rejected one, the
            most likely token after it).
        draft_confidences: the model's top-1 probability at each draft's place (when sampling: the
            probability of ``draft_checks`` under the model's sampling distribution).
        drafts_accepted: leading drafts equal to ``draft_checks``.
        correction: the model's token in place of the first rejected draft (None if none rejected).
        correction_text: that token decoded on its own ("" when none).
        mask_blocks: verification: the numbers of accepted drafts that a block of ``k_max - 1`` masks
            followed in this pass (``[len(drafts)]`` for the linear layout).
        block_proposals, block_texts, block_confidences: the proposals of each mask block (in the
            order of ``mask_blocks``), their texts and confidences.
        next_drafts: the drafts the next pass feeds: the proposals of the block that followed the accepted
            prefix, or none (no such block, or the answer ended).
        shared_sequences: sequences whose rows shared this forward pass (1: it ran alone; more: a batch runner,
            :mod:`model.engine.batch`, carried other generations' rows in the same pass).
        shared_rows: rows of the whole shared pass (``fed_tokens`` when it ran alone).
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
    mask_blocks: list[int] = field(default_factory=list)
    block_proposals: list[list[int]] = field(default_factory=list)
    block_texts: list[list[str]] = field(default_factory=list)
    block_confidences: list[list[float]] = field(default_factory=list)
    next_drafts: list[int] = field(default_factory=list)
    shared_sequences: int = 1
    shared_rows: int = 0

    @property
    def counted_drafts(self) -> tuple[int, int]:
        """``(proposed, accepted)`` drafts of this pass that count in acceptance metrics: none after a stop
        token or ``max_new_tokens`` (a draft past the end of the answer was never needed)."""
        if not self.fed_drafts:
            return 0, 0
        accepted = min(self.drafts_accepted, len(self.kept))
        ended = self.stopped or self.block_end == "max_new_tokens"
        proposed = min(self.fed_drafts, len(self.kept)) if ended else self.fed_drafts
        return proposed, min(accepted, proposed)

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
        sampling: the sampling settings (:class:`~model.engine.sampling.Sampling`; the seed actually used when
            sampling).
    """

    text: str
    token_ids: list[int]
    passes: list[PassRecord] = field(default_factory=list)
    strategy: str = "standard"
    sampling: dict = field(default_factory=GREEDY.to_dict)

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
    def mean_acceptance_length(self) -> float:
        """Tokens per forward pass, the model's own token included (vLLM / llama.cpp's "mean acceptance
        length"; the paper's effective k)."""
        return self.effective_k

    @property
    def drafts_proposed(self) -> int:
        """Drafts fed for checking (verification), none counted past the end of the answer."""
        return sum(p.counted_drafts[0] for p in self.passes)

    @property
    def drafts_accepted(self) -> int:
        """Drafts accepted (verification), none counted past the end of the answer."""
        return sum(p.counted_drafts[1] for p in self.passes)

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts (None without drafts)."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else None

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """Per draft position j = 1, 2, ...: the share of passes that fed a draft at j in which it was
        accepted (vLLM's per-position acceptance rate; a draft after a rejected one counts as rejected)."""
        return acceptance_by_position(self.passes)

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
            "forward_passes": self.forward_passes, "effective_k": self.effective_k,
            "mean_acceptance_length": self.mean_acceptance_length, "drafts_proposed": self.drafts_proposed,
            "drafts_accepted": self.drafts_accepted, "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position, "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second, "sampling": self.sampling,
            "passes": [p.to_dict() for p in self.passes],
        }


def acceptance_by_position(passes: Sequence[PassRecord]) -> list[float | None]:
    """Per draft position j = 1, 2, ...: accepted / proposed over ``passes`` (:attr:`PassRecord.counted_drafts`:
    nothing past the end of an answer), None where no draft was proposed."""
    proposed: list[int] = []
    accepted: list[int] = []
    for p in passes:
        n, a = p.counted_drafts
        while len(proposed) < n:
            proposed.append(0)
            accepted.append(0)
        for j in range(n):
            proposed[j] += 1
            accepted[j] += int(j < a)
    return [a / n if n else None for a, n in zip(accepted, proposed)]


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


def check_finite(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (``[T, V]``) when every value is finite.

    Raises:
        NonFiniteLogitsError: a NaN or infinite logit (no token can be chosen from it).
    """
    if not bool(torch.isfinite(logits).all()):
        bad = (~torch.isfinite(logits)).any(-1).nonzero().flatten().tolist()
        raise NonFiniteLogitsError(
            f"The forward pass produced NaN or infinite logits at {len(bad)} of {logits.shape[0]} positions; "
            "no token can be chosen. The weights or the dtype cannot represent this computation "
            "(e.g. float16 on a CPU); load the model in float32 or bfloat16.")
    return logits


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
    logits[:, mask_token_id] = float("-inf")
    top, tokens = logits.max(dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    if not bool(torch.isfinite(top).all() and torch.isfinite(lse).all()):  # a NaN or +inf logit reaches both
        check_finite(logits.masked_fill(torch.isneginf(logits), 0.0))  # says where; -inf alone is a masked logit
    conf = torch.exp(top - lse)  # the top-1 softmax probability: one pass for max, one for logsumexp
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
class PassLayout:
    """The tokens one forward pass feeds and where they sit.

    ``tokens`` = ``pending`` real tokens, ``drafts`` draft tokens, then one block of ``masks_per_block``
    mask tokens for each prefix in ``blocks`` (the number of accepted drafts the block follows; block
    strategies: one block after the pending tokens). The linear layout is plain causal attention at
    consecutive positions (``positions`` and ``visible`` None). A tree layout (verification with blocks
    after several prefixes) puts block ``a``'s ``j``-th mask at the position after the ``a``-th draft plus
    ``j``, and lets it see the pending tokens, the first ``a`` drafts and its own earlier masks only.

    Attributes:
        positions: per fed token, its position offset from the first fed token (None: 0, 1, 2, ...).
        visible: ``[T, T]`` bool, which fed tokens each fed token attends to (None: causal); every
            token also sees the whole KV cache.
    """

    tokens: list[int]
    pending: int
    drafts: int
    blocks: tuple[int, ...]
    masks_per_block: int
    positions: list[int] | None = None
    visible: torch.Tensor | None = None

    @property
    def num_masks(self) -> int:
        """Mask tokens fed (all of them trailing)."""
        return len(self.blocks) * self.masks_per_block

    @property
    def logits_to_keep(self) -> int:
        """Positions whose logits the pass needs: the last pending token, each draft, each mask."""
        return 1 + self.drafts + self.num_masks


def lay_out(pending: Sequence[int], drafts: Sequence[int], strategy: Strategy, mask_token_id: int) -> PassLayout:
    """The layout of the next forward pass (:class:`PassLayout`)."""
    p, d, m = len(pending), len(drafts), strategy.num_masks
    blocks = strategy.mask_blocks(d) if strategy.verifies else (0,)  # type: ignore[attr-defined]
    if m == 0:
        blocks = ()
    tokens = list(pending) + list(drafts) + [mask_token_id] * (m * len(blocks))
    if blocks in ((), (d,)):  # masks right after the last real token: plain causal attention
        return PassLayout(tokens, p, d, blocks, m)
    t = len(tokens)
    positions = list(range(p + d))
    visible = torch.zeros(t, t, dtype=torch.bool)
    visible[: p + d, : p + d] = torch.ones(p + d, p + d, dtype=torch.bool).tril_()
    for i, a in enumerate(blocks):
        start = p + d + i * m
        positions += [p + a + j for j in range(m)]
        visible[start : start + m, : p + a] = True
        visible[start : start + m, start : start + m] = torch.ones(m, m, dtype=torch.bool).tril_()
    return PassLayout(tokens, p, d, blocks, m, positions, visible)


@dataclass
class Acceptance:
    """What the accept phase decided for one pass.

    Attributes:
        kept: the tokens to emit, before trimming.
        reason: why the block ends (see :attr:`PassRecord.block_end`).
        drafts_accepted: leading drafts equal to the model's own choice (verification; else 0).
        correction: the model's token in place of the first rejected draft, or None.
        next_drafts: the drafts the next pass feeds (verification; else empty).
        next_draft_probs: when sampling, ``[len(next_drafts), V]`` the distributions they were drawn from.
    """

    kept: list[int]
    reason: str
    drafts_accepted: int = 0
    correction: int | None = None
    next_drafts: list[int] = field(default_factory=list)
    next_draft_probs: torch.Tensor | None = None


def accept(lm: LoadedModel, strategy: Strategy, generated: Sequence[int], layout: PassLayout, greedy: Sequence[int],
           conf: Sequence[float], drafts: Sequence[int]) -> Acceptance:
    """The accept phase: which of a pass's proposals become output.

    Args:
        generated: tokens emitted before this pass.
        layout: the pass's :class:`PassLayout`; ``drafts``: the drafts it fed.
        greedy, conf: greedy ids and confidences at the last pending token, each draft and each mask
            (``layout.logits_to_keep`` of each).
    """
    d, m = layout.drafts, layout.masks_per_block
    if strategy.verifies:
        own = greedy[: d + 1]  # the model's token after 0, 1, ..., d accepted drafts
        a = accept_drafts(drafts, own[:d])
        nxt: list[int] = []
        if a in layout.blocks:
            i = layout.blocks.index(a)
            nxt = list(greedy[d + 1 + i * m : d + 1 + (i + 1) * m])
        rejected = a < d
        return Acceptance(list(drafts[:a]) + [own[a]], "draft rejected" if rejected else "k_max", a,
                          own[a] if rejected else None, nxt)
    n, reason = strategy.accept(conf)
    cut = cut_broken_utf8(lm, generated, greedy, n)
    if cut < n:
        n, reason = cut, "utf-8"
    return Acceptance(list(greedy[:n]), reason)


def accept_sampled(lm: LoadedModel, strategy: Strategy, generated: Sequence[int], layout: PassLayout,
                   probs: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None,
                   sampler: TokenSampler) -> tuple[list[int], list[float], Acceptance]:
    """The accept phase when sampling (:mod:`model.engine.sampling`).

    Block strategies draw a token at the last pending token and at each mask, in order, and keep a leading run
    as :meth:`Strategy.accept` decides from the drawn tokens' probabilities. Verification accepts drafts by
    speculative sampling, then draws the tokens of the mask block after the accepted prefix, if there is one:
    the next pass's drafts, with their distributions (the other blocks are not drawn; their most likely
    tokens are recorded).

    Args:
        probs: ``[layout.logits_to_keep, V]`` sampling distributions at the last pending token, each draft and
            each mask.
        draft_probs: ``[len(drafts), V]`` the distributions the drafts were drawn from (None without drafts).

    Returns:
        ``(tokens, probabilities, acceptance)``: per position the token this pass chose there (at a draft's
        place: the draft if accepted, the replacement at the first rejected one, the most likely token after
        it; at each mask: the drawn token, or the most likely one in a block not drawn) and its probability
        under that position's distribution.
    """
    d, m = layout.drafts, layout.masks_per_block
    if not strategy.verifies:
        tokens, conf = draw_block(sampler, probs)
        n, reason = strategy.accept(conf)
        cut = cut_broken_utf8(lm, generated, tokens, n)
        if cut < n:
            n, reason = cut, "utf-8"
        return tokens, conf, Acceptance(list(tokens[:n]), reason)
    a, token, _ = speculative_accept(sampler, drafts, probs[: d + 1], draft_probs)
    tokens = list(drafts[:a]) + [token] + probs[a + 1:].argmax(-1).tolist()
    nxt, nxt_probs = [], None
    if a in layout.blocks:  # only the block after the accepted prefix is drawn: the next pass's drafts
        start = d + 1 + layout.blocks.index(a) * m
        nxt_probs = probs[start:start + m]
        nxt, _ = draw_block(sampler, nxt_probs)
        tokens[start:start + m] = nxt
    conf = [float(probs[j, t]) for j, t in enumerate(tokens)]
    rejected = a < d
    return tokens, conf, Acceptance(list(drafts[:a]) + [token], "draft rejected" if rejected else "k_max", a,
                                    token if rejected else None, nxt, nxt_probs)


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


def cut_at_stop_string(lm: LoadedModel, generated: Sequence[int], kept: Sequence[int]) -> int | None:
    """Part of the trim phase: the number of ``kept`` tokens up to and including the one that completes
    one of :attr:`LoadedModel.stop_strings` in the answer text (None when none does; the text before
    this pass never holds one, or decoding would have stopped)."""
    if not lm.stop_strings or not kept:
        return None
    decode = lm.tokenizer.decode
    if not any(t in decode(list(generated) + list(kept)) for t in lm.stop_strings):
        return None
    for i in range(1, len(kept) + 1):
        if any(t in decode(list(generated) + list(kept[:i])) for t in lm.stop_strings):
            return i
    return None


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


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU. Timings call it before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- decoder
#: Prompt tokens per chunk of a chunked prefill (:meth:`Decoder.prefill_chunk`): SmolLM2-135M in bf16 on one CPU
#: thread computes one in ~0.3 s, so Stop waits at most about that long.
PREFILL_CHUNK = 256


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
        sampling: temperature, top-k, top-p, seed (:mod:`model.engine.sampling`); None or temperature 0:
            greedy decoding.
        prefix: ``(cache, ids)``: a KV cache of this model holding ``ids`` (an earlier generation's
            :attr:`cached_ids`, e.g. the previous turn of a chat); its longest common prefix with the prompt is
            reused instead of computed again (prefix caching, as serving engines do). The cache becomes this
            decoder's (cropped).
        width: for ``verify:auto``, the :class:`~model.engine.width.AutoWidth` that chooses each pass's k_max and
            layout (default: :func:`~model.engine.width.auto_width` of the model, measured on first use).

    Raises (at construction):
        ValueError: empty prompt, bad max_new_tokens.
        ContextBudgetError: prompt + max_new_tokens + look-ahead beyond the model's positions.
    """

    def __init__(self, lm: LoadedModel, prompt_ids: Sequence[int], strategy: Strategy, max_new_tokens: int = 128,
                 sampling: Sampling | None = None, prefix: tuple[Any, Sequence[int]] | None = None,
                 width: Any = None):
        if len(prompt_ids) == 0:
            raise ValueError("The prompt is empty: nothing to condition on.")
        self.lm = lm
        self.strategy = strategy
        self.sampling = sampling or GREEDY
        self.sampler = None if self.sampling.greedy else TokenSampler(self.sampling.seed)
        self.draft_probs: torch.Tensor | None = None
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
        self._prefill_seconds = 0.0  # prompt chunks fed before the first pass (prefill_chunk), and their tokens
        self._prefilled = 0
        self._reused = 0
        if prefix is not None:
            self._reuse(*prefix)
        #: verify:auto: the width policy (:class:`~model.engine.width.AutoWidth`; measured for the model when not
        #: given), and the rows other sequences put in this decoder's last shared pass and the tokens they emitted
        #: there (set by a batch runner).
        self.width = width
        self.other_rows = 0
        self.other_tokens = 0.0

    def _reuse(self, cache: Any, cache_ids: Sequence[int]) -> None:
        """Start from a KV cache that holds ``cache_ids`` (a previous generation's :attr:`cached_ids` on the same
        model): it is cropped to the longest common prefix of ``cache_ids`` and the prompt (at most all but the
        prompt's last token, which the first pass feeds) and the rest of the prompt stays pending. A cache of
        another kind or length, or with nothing in common, is not used."""
        fresh = self.cache
        if type(cache) is not type(fresh) or getattr(cache, "engine", None) is not getattr(fresh, "engine", None):
            return
        held = cache.get_seq_length()
        if held != len(cache_ids):
            return
        n, limit = 0, min(len(cache_ids), len(self.prompt_ids) - 1)
        while n < limit and int(cache_ids[n]) == self.prompt_ids[n]:
            n += 1
        if n == 0:
            return
        if held > n:
            cache.crop(-(held - n))
        self.cache, self.cached_ids, self.pending = cache, self.prompt_ids[:n], self.prompt_ids[n:]
        self._reused = n

    @property
    def reused(self) -> int:
        """Prompt tokens whose KV entries came from a previous generation's cache (``prefix``), not computed."""
        return self._reused

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to feed before the first pass (its last token always goes with that pass)."""
        return 0 if self.passes else max(0, len(self.pending) - 1)

    @torch.inference_mode()
    def prefill_chunk(self, max_tokens: int = PREFILL_CHUNK) -> int:
        """Feed up to ``max_tokens`` of the prompt into the KV cache without proposing (chunked prefill): a caller
        that polls between chunks (Stop) waits at most one chunk. The chunks' seconds and tokens count in the
        first pass's record (it is the prefill).

        Returns:
            The prompt tokens still to feed before the first pass (:attr:`prefill_left`).
        """
        n = min(int(max_tokens), self.prefill_left)
        if n <= 0:
            return 0
        lm, chunk = self.lm, self.pending[:n]
        sync(lm.device)
        t0 = time.perf_counter()
        lm.forward(torch.tensor([chunk], dtype=torch.long, device=lm.device), self.cache, num_masks=0,
                   logits_to_keep=1)
        sync(lm.device)
        self._prefill_seconds += time.perf_counter() - t0
        self._prefilled += n
        self.cached_ids.extend(chunk)
        self.pending = self.pending[n:]
        return self.prefill_left

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
        lm = self.lm
        layout = self.next_layout()
        sync(lm.device)
        t0 = time.perf_counter()
        ids = torch.tensor([layout.tokens], dtype=torch.long, device=lm.device)
        logits = lm.forward(ids, self.cache, num_masks=layout.num_masks, logits_to_keep=layout.logits_to_keep,
                            positions=layout.positions, visible=layout.visible)[0]
        return self.finish_pass(layout, logits, t0)

    def next_layout(self) -> PassLayout:
        """What the next forward pass feeds (:class:`PassLayout`): the pending tokens, the drafts and the mask
        blocks. A batch runner (:mod:`model.engine.batch`) feeds it with other sequences' rows, then calls
        :meth:`finish_pass` with this sequence's logits."""
        strategy = self.strategy
        if getattr(strategy, "auto", False):
            strategy = self._auto_layout(strategy)
        return lay_out(self.pending, self.drafts[:strategy.num_masks], strategy, self.lm.mask_token_id)

    def _auto_layout(self, strategy: Any) -> Strategy:
        """``verify:auto``: this pass's fixed layout, from the width policy, the rows beside it and the acceptance
        this generation has seen so far (lossless whatever it is)."""
        if self.width is None:
            from .width import auto_width

            self.width = auto_width(self.lm)
        with_drafts = sum(1 for p in self.passes if p.counted_drafts[0])
        acc = self.width.acceptance_for(acceptance_by_position(self.passes), with_drafts)
        k, blocks = self.width.choose(strategy.k_max, self.other_rows, acc, self.other_tokens)
        return strategy.at(k, blocks)

    @torch.inference_mode()
    def finish_pass(self, layout: PassLayout, logits: torch.Tensor, t0: float) -> PassRecord:
        """Accept, trim and commit one pass from its logits (``[layout.logits_to_keep, V]``), the KV cache
        already extended by the pass; ``t0``: ``time.perf_counter()`` when the pass started. Returns its record.

        Raises:
            NonFiniteLogitsError: the pass produced NaN / infinite logits (the decoder stops).
        """
        lm, s, drafts = self.lm, self.strategy, self.drafts[:layout.drafts]  # verify:auto may feed fewer
        draft_probs = None if self.draft_probs is None else self.draft_probs[:layout.drafts]
        try:
            if self.sampler is None:
                greedy, conf = propose(logits, lm.mask_token_id)
            else:
                probs = self.sampling.probabilities(check_finite(logits.float()), lm.mask_token_id)
        except NonFiniteLogitsError:
            self.done = True
            raise
        if self.sampler is None:
            acc = accept(lm, s, self.generated, layout, greedy, conf, drafts)
        else:
            greedy, conf, acc = accept_sampled(lm, s, self.generated, layout, probs, drafts, draft_probs,
                                               self.sampler)
        kept, reason, stopped = trim(acc.kept, acc.reason, self.max_new_tokens - len(self.generated), self._stop)
        cut = cut_at_stop_string(lm, self.generated, kept)
        if cut is not None:
            kept, reason, stopped = kept[:cut], "stop string", True
        in_cache = commit(self.cache, len(layout.tokens), len(self.pending), kept, s.verifies)
        sync(lm.device)
        seconds = time.perf_counter() - t0
        if not self.passes:  # the prefill's chunks (prefill_chunk) belong to the first pass
            seconds += self._prefill_seconds

        self.cached_ids.extend(self.pending + in_cache)
        self.generated.extend(kept)
        self.pending = kept[-1:] if s.verifies else kept
        self.done = stopped or len(self.generated) >= self.max_new_tokens
        self.drafts = [] if self.done else acc.next_drafts
        self.draft_probs = None if self.done else acc.next_draft_probs
        rec = self._record(layout, drafts, greedy, conf, acc, kept, reason, stopped, seconds)
        self.passes.append(rec)
        return rec

    def _record(self, layout: PassLayout, drafts: Sequence[int], greedy: Sequence[int], conf: Sequence[float],
                acc: Acceptance, kept: list[int], reason: str, stopped: bool, seconds: float) -> PassRecord:
        """The pass's :class:`PassRecord`. ``proposals`` are the model's token after the last fed draft and
        the proposals of the block that follows it (the whole block for block strategies)."""
        decode = self.lm.tokenizer.decode
        d, m = layout.drafts, layout.masks_per_block
        blocks = [list(greedy[d + 1 + i * m : d + 1 + (i + 1) * m]) for i in range(len(layout.blocks))]
        block_conf = [list(conf[d + 1 + i * m : d + 1 + (i + 1) * m]) for i in range(len(layout.blocks))]
        last = layout.blocks.index(d) if d in layout.blocks else None
        proposals = [greedy[d]] + (blocks[last] if last is not None else [])
        confidences = [conf[d]] + (block_conf[last] if last is not None else [])
        return PassRecord(
            index=len(self.passes), shared_rows=len(layout.tokens),
            fed_real=layout.pending + (self._prefilled if not self.passes else 0),
            fed_masks=layout.num_masks, proposals=proposals,
            proposal_texts=[decode([t]) for t in proposals], confidences=confidences, kept=kept,
            text=self._text_delta(), accepted=len(acc.kept), seconds=seconds, stopped=stopped, block_end=reason,
            fed_drafts=d, drafts=list(drafts), draft_texts=[decode([t]) for t in drafts], draft_checks=list(greedy[:d]),
            draft_confidences=list(conf[:d]), drafts_accepted=acc.drafts_accepted, correction=acc.correction,
            correction_text=decode([acc.correction]) if acc.correction is not None else "",
            mask_blocks=list(layout.blocks) if self.strategy.verifies else [],
            block_proposals=blocks if self.strategy.verifies else [],
            block_texts=[[decode([t]) for t in b] for b in blocks] if self.strategy.verifies else [],
            block_confidences=block_conf if self.strategy.verifies else [], next_drafts=list(self.drafts),
        )

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
        sampling = self.sampling.to_dict()
        if self.sampler is not None:
            sampling["seed"] = self.sampler.seed
        return GenerationResult(text=self._text, token_ids=list(self.generated), passes=list(self.passes),
                                strategy=self.strategy.spec, sampling=sampling)


def run(lm: LoadedModel, prompt_ids: Sequence[int], strategy: Strategy, max_new_tokens: int = 128,
        sampling: Sampling | None = None) -> GenerationResult:
    """Decode to the end from prompt ids and return the totals (greedy unless ``sampling`` says otherwise).

    Raises:
        ValueError, ContextBudgetError: as :class:`Decoder`.
        NonFiniteLogitsError: a pass produced NaN / infinite logits.
    """
    dec = Decoder(lm, prompt_ids, strategy, max_new_tokens, sampling)
    for _ in dec:
        pass
    return dec.result()


def generate(
    lm: LoadedModel, prompt: str | Sequence[dict], strategy: Strategy, max_new_tokens: int = 128,
    sampling: Sampling | None = None,
) -> GenerationResult:
    """Run one generation from a user message or a messages-format chat history.

    Raises:
        ValueError: empty prompt, bad max_new_tokens; ContextBudgetError, NonFiniteLogitsError.
    """
    return run(lm, lm.prompt_ids(prompt), strategy, max_new_tokens, sampling)


def hf_generate(lm: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int,
                sampling: Sampling | None = None) -> list[int]:
    """Reference: transformers ``generate`` greedy (``do_sample=False``), new ids only; with ``sampling`` at a
    temperature above 0, transformers' own sampling with the same temperature, top-k and top-p (seeded with
    ``torch.manual_seed`` when a seed is given): a baseline for speed, not the same draws as ours.

    Uses the same stop tokens (none: runs to ``max_new_tokens``); the mask token is suppressed as in
    our loop.
    """
    sampling = sampling or GREEDY
    if sampling.greedy:
        how: dict = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        how = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)
    stop = list(lm.stop_token_ids) or None
    pad = lm.tokenizer.pad_token_id
    if pad is None:
        pad = stop[0] if stop else 0
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, eos_token_id=stop,
            pad_token_id=pad, suppress_tokens=[lm.mask_token_id], **how,
        )
    return out[0, ids.shape[1]:].tolist()
