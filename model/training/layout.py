"""Training layouts for MTP self-distillation (paper 3.3; docs/DESIGN.md).

A batch of ground-truth sequences (prompt + response + EOS) becomes one *blocked layout*: after
the ground-truth token at each region's **anchor** position ``a`` we insert ``k - 1`` mask
tokens. The student predicts ``k`` tokens per region: at the anchor (block index 0, the
ordinary next token ``x[a+1]``) and at each mask (block index ``j`` predicts ``x[a+1+j]``).

* Ground-truth tokens keep their original position ids (masks do not shift positions); mask
  ``j`` of the region at anchor ``a`` gets position ``a + j``.
* Attention ("blocked"): ground truth attends causally to ground truth only, skipping every mask
  span; a mask attends to the ground truth up to its anchor and to the earlier masks of its own
  span, never to another span. The mask is a float 4D tensor (0 / -inf).
* Regions sit on a grid over the *response* part: anchors ``r - 1 + offset + m * spacing``
  (``r`` = index of the first response token, so the last prompt token is a possible anchor),
  at most ``num_regions`` per sequence (default ``N / (2 k_max)``). The grid offset and ``k`` are
  drawn at random once per training step (:func:`sample_block`).
* EOS rule: an anchor must come before the first EOS of the response, so the first region whose
  ground truth reaches the EOS is the last; block positions that fall *after* the EOS are marked
  ``pred_after_eos`` and get the EOS as their label (the region is padded with EOS).

:func:`build_span_layout` gives the two-phase form of the same regions used by activated
adapters: phase 1 caches the plain ground-truth sequence, phase 2 feeds only the mask
spans over that KV cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

# Slot kinds in a layout row.
GT, MASK, PAD = 0, 1, 2


@dataclass(frozen=True)
class Region:
    """One MTP region: row ``batch``, anchor position ``anchor`` (0-based index into the
    ground-truth sequence), block size ``k``; ``eos`` = index of the row's first response EOS
    (or None when the sequence was truncated before it)."""

    batch: int
    anchor: int
    k: int
    eos: int | None


@dataclass
class Layout:
    """A blocked training layout (single forward pass, paper 3.3).

    Shapes: ``B`` rows, ``L`` layout slots (ground truth + masks + padding), ``P`` predicted
    positions (``sum over regions of k``), ordered region by region, block index ascending.

    Attributes:
        input_ids: ``[B, L]`` long: ground truth with mask tokens inserted, padded with ``pad_token_id``.
        position_ids: ``[B, L]`` long: ground truth keeps its index; mask ``j`` of anchor ``a`` gets ``a + j``.
        attention_mask: ``[B, 1, L, L]`` float32, 0 where query (row) may attend key (column), -inf elsewhere.
        kind: ``[B, L]`` long: 0 ground truth, 1 mask, 2 padding.
        gt_index: ``[B, N]`` long: layout slot of each ground-truth token (-1 past the row's end).
        pred_batch, pred_index: ``[P]`` long: row and layout slot whose logits make each prediction.
        pred_region: ``[P]`` long: index into ``regions``.
        pred_block: ``[P]`` long: block index ``j`` in ``0 .. k-1``.
        pred_target: ``[P]`` long: ground-truth position predicted (``anchor + 1 + j``).
        pred_after_eos: ``[P]`` bool: the target lies after the row's EOS (label = EOS).
        regions: the :class:`Region` list.
        sequences: the ground-truth rows (lists of token ids, unpadded).
        k: block size of this step.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    kind: torch.Tensor
    gt_index: torch.Tensor
    pred_batch: torch.Tensor
    pred_index: torch.Tensor
    pred_region: torch.Tensor
    pred_block: torch.Tensor
    pred_target: torch.Tensor
    pred_after_eos: torch.Tensor
    regions: list[Region]
    sequences: list[list[int]]
    k: int

    @property
    def num_predictions(self) -> int:
        """``P``: predicted positions in the batch."""
        return int(self.pred_index.numel())

    def to(self, device: torch.device | str) -> "Layout":
        """Move every tensor to ``device`` (returns self)."""
        for name in ("input_ids", "position_ids", "attention_mask", "kind", "gt_index", "pred_batch", "pred_index",
                     "pred_region", "pred_block", "pred_target", "pred_after_eos"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def default_num_regions(seq_len: int, k_max: int) -> int:
    """Paper default ``M = N / (2 k_max)`` regions per sequence (at least 1)."""
    return max(1, seq_len // (2 * k_max))


def sample_block(rng: random.Random, k_max: int, spacing: int, k_min: int = 2) -> tuple[int, int]:
    """Draw this step's block size ``k`` uniformly from ``[k_min, k_max]`` and grid offset from ``[0, spacing)``.

    Raises:
        ValueError: ``k_max < k_min`` or ``spacing < 1``.
    """
    if k_max < k_min:
        raise ValueError(f"k_max must be at least {k_min}, got {k_max}.")
    if spacing < 1:
        raise ValueError(f"The region spacing must be ≥ 1, got {spacing}.")
    return rng.randint(k_min, k_max), rng.randrange(spacing)


def place_regions(
    sequences: Sequence[Sequence[int]],
    response_starts: Sequence[int],
    *,
    k: int,
    offset: int,
    spacing: int,
    num_regions: int,
    eos_token_id: int | Sequence[int],
) -> list[Region]:
    """Anchors on the grid ``r - 1 + offset + m * spacing`` of each row's response part.

    An anchor must lie before the row's first EOS at or after ``r`` (the EOS rule) and before the
    row's last token; at most ``num_regions`` regions per row. A row whose response offers fewer
    anchor places than ``offset`` (a short answer) takes the offset modulo that number, so every row
    with a response token holds at least one region whatever the offset (no row, and so no batch,
    is ever without one).

    Raises:
        ValueError: a response start outside ``[1, len(row) - 1]``, bad ``k`` / ``spacing``.
    """
    if k < 1:
        raise ValueError(f"k must be ≥ 1, got {k}.")
    if spacing < 1 or num_regions < 1:
        raise ValueError("spacing and num_regions must be ≥ 1.")
    eos_ids = {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}
    regions: list[Region] = []
    for b, (seq, r) in enumerate(zip(sequences, response_starts)):
        n = len(seq)
        if not 1 <= r < n:
            raise ValueError(f"Row {b}: the response starts at {r} but the sequence has {n} tokens "
                             "(need a non-empty prompt and at least one response token).")
        eos = next((t for t in range(r, n) if int(seq[t]) in eos_ids), None)
        limit = eos if eos is not None else n - 1  # anchors < limit
        places = max(limit - (r - 1), 1)  # anchor places r - 1 .. limit - 1
        for m in range(num_regions):
            a = r - 1 + offset % places + m * spacing
            if a >= limit:
                break
            regions.append(Region(b, a, k, eos))
    return regions


def build_layout(
    sequences: Sequence[Sequence[int]],
    regions: Sequence[Region],
    *,
    mask_token_id: int,
    pad_token_id: int,
) -> Layout:
    """Build the blocked layout of ``regions`` over ``sequences`` (paper 3.3).

    Three steps: lay out each row (ground truth with each region's masks after its anchor), pad the
    rows to one width, and build the blocked attention mask (:func:`blocked_attention_mask`).

    Args:
        sequences: ``B`` ground-truth rows (token ids), possibly of different lengths.
        regions: from :func:`place_regions` (or hand-made: anchors within the row, any ``k ≥ 1``;
            regions of one row must have distinct anchors).
        mask_token_id: the mask token (paper 3.1).
        pad_token_id: filler for the slots after a row's end.

    Returns:
        A :class:`Layout` on the CPU.

    Raises:
        ValueError: empty batch, an anchor outside its row, two regions at one anchor.
    """
    if not sequences:
        raise ValueError("Empty batch: no sequences to lay out.")
    by_row: list[dict[int, int]] = [dict() for _ in sequences]  # anchor -> region id, per row
    for rid, reg in enumerate(regions):
        if not 0 <= reg.batch < len(sequences) or not 0 <= reg.anchor < len(sequences[reg.batch]):
            raise ValueError(f"Region {reg} lies outside its row.")
        if reg.anchor in by_row[reg.batch]:
            raise ValueError(f"Two regions at anchor {reg.anchor} of row {reg.batch}.")
        by_row[reg.batch][reg.anchor] = rid

    rows, preds = [], []
    for b, seq in enumerate(sequences):
        row, row_preds = _lay_out_row(b, seq, by_row[b], regions, mask_token_id)
        rows.append(row)
        preds += row_preds
    width, n = max(len(r["ids"]) for r in rows), max(len(s) for s in sequences)

    def pad(key: str, value: int, to: int = width) -> torch.Tensor:
        return torch.tensor([r[key] + [value] * (to - len(r[key])) for r in rows], dtype=torch.long)

    position_ids, kind = pad("pos", 0), pad("kind", PAD)
    mask = blocked_attention_mask(position_ids, kind, pad("limit", -1), pad("span", -2), pad("j", 0))
    preds.sort(key=lambda p: (p[0], p[1]))  # region by region, block index ascending

    def col(i: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor([p[i] for p in preds], dtype=dtype)

    return Layout(
        input_ids=pad("ids", pad_token_id), position_ids=position_ids, attention_mask=mask, kind=kind,
        gt_index=pad("gt", -1, n), pred_batch=col(2), pred_index=col(3), pred_region=col(0), pred_block=col(1),
        pred_target=col(4), pred_after_eos=col(5, torch.bool), regions=list(regions),
        sequences=[list(map(int, s)) for s in sequences], k=max((r.k for r in regions), default=1),
    )


def _lay_out_row(b: int, seq: Sequence[int], anchors: dict[int, int], regions: Sequence[Region], mask_token_id: int
                 ) -> tuple[dict[str, list[int]], list[tuple[int, int, int, int, int, bool]]]:
    """One row of a layout: per slot its token, position, kind, attention limit (the last ground-truth
    position it may see), span (region id of a mask, -1 for ground truth) and block index; the slot of
    each ground-truth token; and the row's predictions ``(region id, j, row, slot, target, after EOS)``."""
    row: dict[str, list[int]] = {key: [] for key in ("ids", "pos", "kind", "limit", "span", "j", "gt")}

    def put(token: int, pos: int, kind: int, limit: int, span: int, j: int) -> int:
        for key, v in zip(("ids", "pos", "kind", "limit", "span", "j"), (token, pos, kind, limit, span, j)):
            row[key].append(v)
        return len(row["ids"]) - 1

    preds = []
    for t, tok in enumerate(seq):
        row["gt"].append(put(int(tok), t, GT, t, -1, 0))
        rid = anchors.get(t)
        if rid is None:
            continue
        reg = regions[rid]
        for j in range(reg.k):
            slot = row["gt"][-1] if j == 0 else put(mask_token_id, t + j, MASK, t, rid, j)
            target = t + 1 + j
            preds.append((rid, j, b, slot, target, reg.eos is not None and target > reg.eos))
    return row, preds


def blocked_attention_mask(position_ids: torch.Tensor, kind: torch.Tensor, limit: torch.Tensor, span: torch.Tensor,
                           j: torch.Tensor) -> torch.Tensor:
    """The blocked attention mask of a layout (paper 3.3), ``[B, 1, L, L]`` float32, 0 = may attend.

    A query sees the ground-truth keys up to its ``limit`` position (its own position for ground truth,
    its anchor for a mask), and a mask also sees the earlier masks of its own span; padding sees only
    itself (no empty rows). All inputs are ``[B, L]``.
    """
    is_mask = kind == MASK
    allowed = (kind == GT)[:, None, :] & (kind != PAD)[:, :, None] & (position_ids[:, None, :] <= limit[:, :, None])
    same_span = (span[:, :, None] == span[:, None, :]) & is_mask[:, :, None] & is_mask[:, None, :]
    allowed |= same_span & (j[:, None, :] <= j[:, :, None])
    allowed |= torch.eye(kind.shape[1], dtype=torch.bool)[None] & (kind == PAD)[:, :, None]
    mask = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=torch.float32)
    return mask.masked_fill_(~allowed[:, None], float("-inf"))


@dataclass
class SpanLayout:
    """Two-phase form of a layout (activated adapters).

    Phase 1 runs the padded ground truth ``gt_ids`` ``[B, N]`` with plain causal attention and keeps its
    KV cache. Phase 2 feeds ``span_ids`` ``[B, S]`` (every region's ``k - 1`` masks, region by region,
    padded) at ``span_position_ids`` ``[B, S]`` with ``attention_mask`` ``[B, 1, S, N + S]`` (float32,
    0 / -inf) over cache + spans: a mask sees the cached ground truth up to its anchor and the
    earlier masks of its own span.

    Predicted positions are those of the single-pass :class:`Layout` (same order): block index 0
    reads phase-1 logits at ``gt`` slot ``pred_anchor``; block index ``j ≥ 1`` reads phase-2 logits at
    span slot ``pred_span_slot`` (-1 for ``j = 0``).
    """

    gt_ids: torch.Tensor
    span_ids: torch.Tensor
    span_position_ids: torch.Tensor
    attention_mask: torch.Tensor
    span_kind: torch.Tensor
    pred_batch: torch.Tensor
    pred_block: torch.Tensor
    pred_anchor: torch.Tensor
    pred_span_slot: torch.Tensor
    pred_after_eos: torch.Tensor
    k: int

    @property
    def span_len(self) -> int:
        """``S``: phase-2 inputs per row (padded)."""
        return int(self.span_ids.shape[1])

    def to(self, device: torch.device | str) -> "SpanLayout":
        """Move every tensor to ``device`` (returns self)."""
        for name in ("gt_ids", "span_ids", "span_position_ids", "attention_mask", "span_kind", "pred_batch",
                     "pred_block", "pred_anchor", "pred_span_slot", "pred_after_eos"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def build_span_layout(layout: Layout, *, mask_token_id: int, pad_token_id: int) -> SpanLayout:
    """Rewrite a blocked :class:`Layout` in the two-phase form (cache the ground truth, then the spans).

    Returns:
        A :class:`SpanLayout` whose predictions correspond one-to-one (same order) to ``layout``'s.
    """
    B = len(layout.sequences)
    N = max(len(s) for s in layout.sequences)
    gt_ids = torch.tensor([s + [pad_token_id] * (N - len(s)) for s in layout.sequences], dtype=torch.long)
    rows: list[list[tuple[int, int, int]]] = [[] for _ in range(B)]  # (region id, j, anchor) per span slot
    slot_of: dict[tuple[int, int], int] = {}
    for rid, reg in enumerate(layout.regions):
        for j in range(1, reg.k):
            slot_of[(rid, j)] = len(rows[reg.batch])
            rows[reg.batch].append((rid, j, reg.anchor))
    S = max(1, max(len(r) for r in rows))
    span_ids = torch.full((B, S), pad_token_id, dtype=torch.long)
    span_pos = torch.zeros(B, S, dtype=torch.long)
    span_kind = torch.full((B, S), PAD, dtype=torch.long)
    allowed = torch.zeros(B, S, N + S, dtype=torch.bool)
    for b, row in enumerate(rows):
        for s, (rid, j, a) in enumerate(row):
            span_ids[b, s] = mask_token_id
            span_pos[b, s] = a + j
            span_kind[b, s] = MASK
            allowed[b, s, : a + 1] = True
            for s2, (rid2, j2, _) in enumerate(row):
                if rid2 == rid and j2 <= j:
                    allowed[b, s, N + s2] = True
        for s in range(len(row), S):
            allowed[b, s, N + s] = True  # padding attends to itself only
    mask = torch.zeros(B, 1, S, N + S, dtype=torch.float32)
    mask.masked_fill_(~allowed[:, None], float("-inf"))
    anchors = torch.tensor([layout.regions[int(r)].anchor for r in layout.pred_region.tolist()], dtype=torch.long)
    span_slot = torch.tensor(
        [slot_of.get((int(r), int(j)), -1) for r, j in zip(layout.pred_region.tolist(), layout.pred_block.tolist())],
        dtype=torch.long,
    )
    return SpanLayout(
        gt_ids=gt_ids, span_ids=span_ids, span_position_ids=span_pos, attention_mask=mask, span_kind=span_kind,
        pred_batch=layout.pred_batch.clone(), pred_block=layout.pred_block.clone(), pred_anchor=anchors,
        pred_span_slot=span_slot, pred_after_eos=layout.pred_after_eos.clone(), k=layout.k,
    )
