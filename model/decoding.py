"""MTP decoding strategies (paper 3.4 and 4.5): standard, static k and ConfAdapt.

Every strategy runs the same loop. Pass t feeds the tokens not yet in the KV cache (the prompt
on the first pass, the tokens kept on the previous pass afterwards) followed by
``k_max - 1`` mask tokens at ordinary consecutive positions, with plain causal attention. The
logits at the last real token and at each mask give ``k_max`` greedy proposals and their
confidences (top-1 softmax probability over the full vocabulary, in float32). The strategy keeps
a leading run of them; the KV entries written for the masks are cropped right after the pass,
so the cache only ever holds real tokens.

Each pass yields one :class:`PassRecord`; the app, the evaluation and the benchmarks consume
these records and never touch the model.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import torch
from transformers import DynamicCache

from .checkpoint import LoadedModel


# --------------------------------------------------------------------------- strategies
@dataclass(frozen=True)
class Strategy:
    """How many of a pass's ``k_max`` proposals to keep.

    Attributes:
        name: ``"standard"``, ``"static"`` or ``"confadapt"``.
        k_max: proposals per pass (the pass feeds ``k_max - 1`` mask tokens).
        k: for static k, the fixed block size (``k == k_max``).
        tau: for ConfAdapt, the confidence threshold in [0, 1].
    """

    name: str
    k_max: int
    k: int | None = None
    tau: float | None = None

    @property
    def num_masks(self) -> int:
        """Mask tokens appended per pass: ``k_max - 1``."""
        return self.k_max - 1

    def accept(self, confidences: Sequence[float]) -> int:
        """Number of leading proposals to keep (always ≥ 1).

        Args:
            confidences: ``k_max`` top-1 probabilities, in block order.
        """
        if self.name == "confadapt":
            n = 1
            while n < len(confidences) and confidences[n] >= self.tau:  # type: ignore[operator]
                n += 1
            # The first proposal is always kept, whatever its confidence (paper 4.5).
            return n
        return min(self.k or 1, len(confidences))

    @property
    def label(self) -> str:
        """Short human label: ``standard``, ``static k=3``, ``ConfAdapt tau=0.90 k_max=16``."""
        if self.name == "static":
            return f"static k={self.k}"
        if self.name == "confadapt":
            return f"ConfAdapt tau={self.tau:.2f} k_max={self.k_max}"
        return "standard"

    @property
    def spec(self) -> str:
        """The string :func:`parse_strategy` reads back (``confadapt:0.9:16``)."""
        if self.name == "static":
            return f"static:{self.k}"
        if self.name == "confadapt":
            return f"confadapt:{self.tau:g}:{self.k_max}"
        return "standard"


def standard() -> Strategy:
    """Next-token prediction: one token per forward pass, no masks (the baseline)."""
    return Strategy("standard", k_max=1, k=1)


def static_k(k: int, k_max: int | None = None) -> Strategy:
    """Keep exactly the first ``k`` proposals of each pass (paper 4.5, "static").

    Raises:
        ValueError: ``k < 1`` or ``k > k_max``.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer ≥ 1, got {k!r}.")
    if k_max is not None:
        _check_k_max(k_max)
        if k > k_max:
            raise ValueError(f"k ({k}) cannot exceed k_max ({k_max}).")
    return Strategy("static", k_max=k, k=k)


def confadapt(tau: float, k_max: int = 16) -> Strategy:
    """ConfAdapt: keep the longest leading run with confidence ≥ tau, at least one token (paper 4.5).

    Raises:
        ValueError: tau outside [0, 1] or not a number; k_max < 1.
    """
    try:
        tau = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"The threshold tau must be a number in [0, 1], got {tau!r}.") from None
    if math.isnan(tau) or not 0.0 <= tau <= 1.0:
        raise ValueError(f"The threshold tau must be in [0, 1], got {tau}.")
    _check_k_max(k_max)
    return Strategy("confadapt", k_max=k_max, tau=tau)


MAX_K_MAX = 64


def _check_k_max(k_max: Any) -> None:
    if isinstance(k_max, bool) or not isinstance(k_max, int) or not 1 <= k_max <= MAX_K_MAX:
        raise ValueError(f"k_max must be an integer from 1 to {MAX_K_MAX}, got {k_max!r}.")


def make_strategy(name: str, *, tau: float = 0.9, k_max: int = 16, k: int = 3) -> Strategy:
    """Build a strategy from CLI/app arguments (``standard``, ``static`` or ``confadapt``).

    Raises:
        ValueError: unknown name or invalid parameters.
    """
    name = (name or "").strip().lower()
    if name == "standard":
        return standard()
    if name == "static":
        return static_k(k, k_max)
    if name == "confadapt":
        return confadapt(tau, k_max)
    raise ValueError(f"Unknown strategy {name!r}: use standard, static or confadapt.")


def parse_strategy(spec: str) -> Strategy:
    """Parse ``standard``, ``static:K`` or ``confadapt:TAU[:K_MAX]`` (k_max defaults to 16).

    Raises:
        ValueError: malformed spec.
    """
    parts = spec.strip().lower().split(":")
    try:
        if parts[0] == "standard" and len(parts) == 1:
            return standard()
        if parts[0] == "static" and len(parts) == 2:
            return static_k(int(parts[1]))
        if parts[0] == "confadapt" and len(parts) in (2, 3):
            return confadapt(float(parts[1]), int(parts[2]) if len(parts) == 3 else 16)
    except ValueError as e:
        raise ValueError(f"Bad strategy {spec!r}: {e}") from None
    raise ValueError(f"Bad strategy {spec!r}: use standard, static:K or confadapt:TAU[:K_MAX].")


# --------------------------------------------------------------------------- records
@dataclass
class PassRecord:
    """What one forward pass did (the record the app, evaluation and benchmarks consume).

    Attributes:
        index: 0-based number of the forward pass.
        fed_real: real tokens fed (the prompt on pass 0, then the previous pass's kept tokens).
        fed_masks: mask tokens fed (``k_max - 1``; 0 for standard decoding).
        proposals: ``k_max`` greedy token ids, one per block position.
        proposal_texts: each proposal decoded on its own.
        confidences: ``k_max`` top-1 probabilities (float32 softmax over the full vocabulary).
        kept: token ids emitted by this pass (after stop-token and max_new_tokens trimming).
        text: the decoded text this pass added to the answer.
        accepted: proposals the strategy accepted before trimming (``len(kept)`` unless trimmed).
        seconds: wall-clock seconds of this pass alone (device synchronised).
        stopped: True if this pass emitted a stop token.
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

    @property
    def fed_tokens(self) -> int:
        """All tokens fed to this forward pass (real + masks)."""
        return self.fed_real + self.fed_masks

    def to_dict(self) -> dict:
        """JSON-ready dict (includes ``fed_tokens``)."""
        d = asdict(self)
        d["fed_tokens"] = self.fed_tokens
        return d


@dataclass
class GenerationResult:
    """Totals of one generation.

    Attributes:
        text: the answer (special tokens skipped).
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
        """Tokens per forward pass (paper's acceleration measure)."""
        return self.new_tokens / self.forward_passes if self.passes else 0.0

    @property
    def seconds(self) -> float:
        """Sum of the passes' own seconds."""
        return sum(p.seconds for p in self.passes)

    @property
    def tokens_per_second(self) -> float:
        """new_tokens / seconds."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        """The CLI's ``--json`` object."""
        return {
            "strategy": self.strategy,
            "text": self.text,
            "new_tokens": self.new_tokens,
            "forward_passes": self.forward_passes,
            "effective_k": self.effective_k,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "passes": [p.to_dict() for p in self.passes],
        }


# --------------------------------------------------------------------------- decoder
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_max_new_tokens(max_new_tokens: Any) -> int:
    """Validate max_new_tokens (an integer ≥ 1). Raises ValueError otherwise."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer ≥ 1, got {max_new_tokens!r}.")
    return max_new_tokens


class Decoder:
    """Iterator over the forward passes of one generation (batch size 1).

    Usage::

        dec = Decoder(lm, lm.prompt_ids("What is 2+2?"), confadapt(0.9, 16), max_new_tokens=128)
        for record in dec:   # one PassRecord per forward pass
            print(record.text, end="")
        dec.result()         # GenerationResult

    Invariant after every pass: ``dec.cache`` holds exactly the keys/values of
    ``dec.cached_ids`` (prompt + emitted tokens, minus those still waiting to be fed), never a
    mask token.

    Raises (at construction):
        ValueError: empty prompt, bad max_new_tokens.
    """

    def __init__(self, lm: LoadedModel, prompt_ids: Sequence[int], strategy: Strategy, max_new_tokens: int = 128):
        if len(prompt_ids) == 0:
            raise ValueError("The prompt is empty: nothing to condition on.")
        self.lm = lm
        self.strategy = strategy
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.cache = DynamicCache(config=getattr(lm.model, "config", None))
        self.cached_ids: list[int] = []
        self.pending: list[int] = list(self.prompt_ids)
        self.generated: list[int] = []
        self.passes: list[PassRecord] = []
        self.done = False
        self._text = ""
        self._stop = set(lm.stop_token_ids)

    def __iter__(self) -> Iterator[PassRecord]:
        while not self.done:
            yield self.step()

    @torch.inference_mode()
    def step(self) -> PassRecord:
        """Run one forward pass and return its record. Raises StopIteration when done."""
        if self.done:
            raise StopIteration
        lm, dev = self.lm, self.lm.device
        m = self.strategy.num_masks
        _sync(dev)
        t0 = time.perf_counter()
        ids = torch.tensor([self.pending + [lm.mask_token_id] * m], dtype=torch.long, device=dev)
        logits = lm.forward(ids, self.cache, num_masks=m, logits_to_keep=m + 1)[0].float()
        logits[:, lm.mask_token_id] = float("-inf")  # the mask token is never proposed
        probs = torch.softmax(logits, dim=-1)
        conf, prop = probs.max(dim=-1)
        if m:
            self.cache.crop(-m)  # drop the mask entries (DESIGN.md section 1)
        conf_l, prop_l = conf.tolist(), prop.tolist()
        _sync(dev)
        seconds = time.perf_counter() - t0

        self.cached_ids.extend(self.pending)
        accepted = self.strategy.accept(conf_l)
        kept = prop_l[:accepted][: self.max_new_tokens - len(self.generated)]
        stopped = False
        for i, t in enumerate(kept):
            if t in self._stop:
                kept, stopped = kept[: i + 1], True
                break
        self.generated.extend(kept)
        self.pending = kept
        if stopped or len(self.generated) >= self.max_new_tokens:
            self.done = True
        text = self._text_delta()
        tok = lm.tokenizer
        rec = PassRecord(
            index=len(self.passes), fed_real=int(ids.shape[1]) - m, fed_masks=m, proposals=prop_l,
            proposal_texts=[tok.decode([t]) for t in prop_l], confidences=conf_l, kept=kept, text=text,
            accepted=accepted, seconds=seconds, stopped=stopped,
        )
        self.passes.append(rec)
        return rec

    def _text_delta(self) -> str:
        text = self.lm.tokenizer.decode(self.generated, skip_special_tokens=True)
        if not self.done and text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the rest
        delta = text[len(self._text):] if text.startswith(self._text) else text
        self._text = text
        return delta

    def result(self) -> GenerationResult:
        """Totals so far (complete once iteration has ended)."""
        return GenerationResult(text=self._text, token_ids=list(self.generated), passes=list(self.passes),
                                strategy=self.strategy.spec)


def generate(
    lm: LoadedModel, prompt: str | Sequence[dict], strategy: Strategy, max_new_tokens: int = 128
) -> GenerationResult:
    """Run one generation to the end and return its totals.

    Args:
        lm: the loaded model.
        prompt: a user message or a messages-format chat history.
        strategy: :func:`standard`, :func:`static_k` or :func:`confadapt`.
        max_new_tokens: exact upper bound on generated tokens.

    Raises:
        ValueError: empty prompt, bad max_new_tokens.
    """
    dec = Decoder(lm, lm.prompt_ids(prompt), strategy, max_new_tokens)
    for _ in dec:
        pass
    return dec.result()


def hf_generate(lm: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers ``generate`` greedy (``do_sample=False``), new ids only.

    Uses the same stop tokens; the mask token is suppressed as in our loop.
    """
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=list(lm.stop_token_ids), pad_token_id=lm.tokenizer.pad_token_id,
            suppress_tokens=[lm.mask_token_id], temperature=None, top_p=None, top_k=None,
        )
    return out[0, ids.shape[1]:].tolist()
