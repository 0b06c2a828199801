"""Host-side tile planning shared by the CUDA and Metal paged-attention kernels.

Input: plain host arrays (cu_seqlens_q [S + 1], seq_lens [S]); output: a `TilePlan` whose work
list every layer's launch reads without host syncs (the plan half of plan/run).

Tiles. A query tile holds `block_m // group` tokens of one sequence times the `group` query
heads that share one kv head, so row r of a tile is (token r // group, head r % group) and
each K/V tile is read once for the whole GQA group (rows past ntok * group are padding).
A kv tile is `block_n` keys.

Work list (int32 [num_items, WORK_COLS]), one threadblock per row:
  SEQ         sequence index (row of block_tables)
  TOK0        packed row in q/out of the tile's first token
  NTOK        tokens in the tile (1 .. block_m // group)
  POS0        absolute position of the first token (context_len + its index in the sequence)
  KV_HEAD     kv head
  KV_START    first key of this item's range (a multiple of block_n): 0, or with a window W
              the kv tile holding the tile's first visible key POS0 - W + 1 (whole kv tiles
              left of the window are never visited)
  KV_END      one past its last key; the tile's causal frontier POS0 + NTOK unless split
  SLOT        partial-output slot when the item's tile is split, else -1 (write `out` directly)
  TILE        index of the (sequence, q tile, kv head) the item belongs to
  FIRST_SLOT  first partial slot of that tile (its splits own FIRST_SLOT .. + NUM_SPLITS - 1;
              -1 when it is not split)
  NUM_SPLITS  splits of that tile (1: not split)
  WINDOW      the window W: a windowed plan's items only (`work_columns`)
Items are ordered longest KV range first so the long ones do not finish last.

Split-KV. When too few query tiles exist to fill the GPU (a short suffix over a long prefix, a
decode batch), each tile's key range (a window's: its in-window kv tiles only, so a decode row's
splits follow W, not its context) is cut into chunks of whole kv tiles; every item then
writes a partial (O normalised, log2-sum-exp per row) to its slot and the tile's partials are
merged by log-sum-exp: inside the attention launch by the tile's last split to finish (CUDA),
or by a merge launch over the merge list (int32 [num_tiles, MERGE_COLS]: TOK0, NTOK, KV_HEAD,
FIRST_SLOT, NUM_SPLITS).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

WORK_COLUMNS = ("SEQ", "TOK0", "NTOK", "POS0", "KV_HEAD", "KV_START", "KV_END", "SLOT", "TILE",
                "FIRST_SLOT", "NUM_SPLITS")
MERGE_COLUMNS = ("TOK0", "NTOK", "KV_HEAD", "FIRST_SLOT", "NUM_SPLITS")
(SEQ, TOK0, NTOK, POS0, KV_HEAD, KV_START, KV_END, SLOT, TILE, FIRST_SLOT,
 NUM_SPLITS) = range(len(WORK_COLUMNS))
WORK_COLS, MERGE_COLS = len(WORK_COLUMNS), len(MERGE_COLUMNS)
WINDOW = WORK_COLS  # the column a windowed plan appends


def work_columns(windowed: bool) -> tuple[str, ...]:
    """The work list's columns, as a kernel's prelude names them: a windowed plan's items also
    carry the window W."""
    return WORK_COLUMNS + ("WINDOW",) if windowed else WORK_COLUMNS


def column_constants(prefix: str, names: tuple[str, ...], declare: str) -> str:
    """Source lines naming each column index, e.g. `constexpr int W_SEQ = 0;`, so kernel
    sources read columns by name and cannot drift from this module."""
    return "\n".join(f"{declare} {prefix}{name} = {i};" for i, name in enumerate(names))


@dataclass(frozen=True)
class TilePlan:
    """One forward's work list for one (group, kv heads, tile shape) variant."""

    work: mx.array  # int32 [num_items, len(work_columns(windowed))]
    num_items: int
    num_tiles: int
    num_slots: int  # partial slots: one per item of a split tile
    work_host: np.ndarray
    merge_host: np.ndarray | None  # int32 [num_tiles, MERGE_COLS]; None when nothing is split

    @cached_property
    def merge(self) -> mx.array | None:
        """The merge list on the device, made when a kernel first reads it (Metal's merge
        launch; the CUDA kernel merges inside its attention launch and never reads it)."""
        return None if self.merge_host is None else mx.array(self.merge_host)


def _query_tiles(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, group: int, num_kv_heads: int,
                 block_m: int, seqs: np.ndarray | None):
    """Columns SEQ..KV_HEAD of every (sequence in seqs, q tile, kv head), kv heads innermost."""
    tokens_per_tile = block_m // group
    q_lens = np.diff(cu_seqlens_q).astype(np.int64)
    context_lens = np.asarray(seq_lens, dtype=np.int64) - q_lens
    tiles_per_seq = -(-q_lens // tokens_per_tile)
    if seqs is not None:  # a mask: np.setdiff1d took a quarter of the plan's host time
        # (bench/probes/plan_host.py)
        planned = np.zeros(len(q_lens), dtype=bool)
        planned[np.asarray(seqs)] = True
        tiles_per_seq[~planned] = 0
    seq = np.repeat(np.arange(len(q_lens)), tiles_per_seq)
    # index of each tile inside its sequence: 0, 1, .. per sequence
    first = np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)
    tok_in_seq = (np.arange(len(seq)) - first) * tokens_per_tile
    ntok = np.minimum(tokens_per_tile, q_lens[seq] - tok_in_seq)
    tok0 = np.asarray(cu_seqlens_q, dtype=np.int64)[seq] + tok_in_seq
    pos0 = context_lens[seq] + tok_in_seq
    cols = [np.repeat(c, num_kv_heads) for c in (seq, tok0, ntok, pos0)]
    kv_head = np.tile(np.arange(num_kv_heads), len(seq))
    return cols, kv_head


def split_counts(kv_tiles: np.ndarray, min_items: int, target_items: int,
                 min_chunk: int) -> np.ndarray:
    """Splits per query tile: none when there are min_items tiles already, else chunks of
    >= min_chunk kv tiles making about target_items items."""
    if len(kv_tiles) >= min_items:
        return np.ones_like(kv_tiles)
    chunk = max(min_chunk, -(-int(kv_tiles.sum()) // target_items))
    return np.maximum(1, -(-kv_tiles // chunk))


def build_tile_plan(
    cu_seqlens_q: np.ndarray,
    seq_lens: np.ndarray,
    group: int,
    num_kv_heads: int,
    block_m: int,
    block_n: int,
    num_sms: int,
    ctas_per_sm: int = 2,
    min_chunk: int = 2,
    min_items: int | None = None,
    seqs: np.ndarray | None = None,
    window: int | None = None,
) -> TilePlan:
    """The work list (and merge list when KV is split) of one forward; see the module doc.

    KV is split when the plan has fewer than min_items (default num_sms: one per core)
    query tiles, into about num_sms * ctas_per_sm items of >= min_chunk kv tiles each.
    `seqs` (sorted batch indices) plans only those sequences: the others' rows of `out` are
    left unwritten, for a caller that computes them another way. `window` W (None: full
    causal) starts each tile's keys at the kv tile of its first visible key.
    """
    (seq, tok0, ntok, pos0), kv_head = _query_tiles(cu_seqlens_q, seq_lens, group, num_kv_heads,
                                                    block_m, seqs)
    kv_end = pos0 + ntok
    kv_begin = np.zeros_like(kv_end) if window is None else \
        np.maximum(pos0 - window + 1, 0) // block_n * block_n
    kv_tiles = -(-(kv_end - kv_begin) // block_n)
    min_items = num_sms if min_items is None else min_items
    splits = split_counts(kv_tiles, min_items, num_sms * ctas_per_sm, min_chunk)
    # balanced chunks: split j of a tile covers kv tiles [j*n//k, (j+1)*n//k)
    tile = np.repeat(np.arange(len(seq)), splits)
    j = np.arange(len(tile)) - np.repeat(np.cumsum(splits) - splits, splits)
    k = splits[tile]
    n = kv_tiles[tile]
    start = kv_begin[tile] + (j * n // k) * block_n
    end = np.minimum(kv_begin[tile] + ((j + 1) * n // k) * block_n, kv_end[tile])
    # only split tiles own partial slots: the others write `out` directly
    split = splits > 1
    slots_per_tile = np.where(split, splits, 0)
    first_slot = np.where(split, np.cumsum(slots_per_tile) - slots_per_tile, -1)
    slot = np.where(split[tile], first_slot[tile] + j, -1)
    columns = [seq[tile], tok0[tile], ntok[tile], pos0[tile], kv_head[tile], start, end, slot,
               tile, first_slot[tile], splits[tile]]
    if window is not None:  # past any int32 position a window hides nothing
        columns.append(np.full_like(start, min(window, np.iinfo(np.int32).max)))
    work = np.stack(columns, axis=1).astype(np.int32)
    work = work[np.argsort(-(work[:, KV_END] - work[:, KV_START]), kind="stable")]
    work.flags.writeable = False
    merge_host = None
    if split.any():
        merge_host = np.stack([tok0, ntok, kv_head, first_slot, splits], axis=1).astype(np.int32)
        merge_host.flags.writeable = False
    return TilePlan(
        work=mx.array(work),
        num_items=len(work),
        num_tiles=len(seq),
        num_slots=int(slots_per_tile.sum()),
        work_host=work,
        merge_host=merge_host,
    )
