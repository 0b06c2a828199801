"""Host-side tile planning shared by the CUDA and Metal paged-attention kernels.

Built once per forward through `meta.plan(...)` and read by every layer without host syncs.

Tiles. A query tile holds `block_m // group` tokens of one sequence times the `group` query
heads that share one kv head, so row r of a tile is (token r // group, head r % group) and
each K/V tile is read once for the whole GQA group (rows past ntok * group are padding).
A kv tile is `block_n` keys.

Work list (int32 [num_items, WORK_COLS]), one threadblock per row:
  SEQ       sequence index (row of block_tables)
  TOK0      packed row in q/out of the tile's first token
  NTOK      tokens in the tile (1 .. block_m // group)
  POS0      absolute position of the first token (context_len + its index in the sequence)
  KV_HEAD   kv head
  KV_START  first key of this item's range (a multiple of block_n)
  KV_END    one past its last key; the tile's causal frontier POS0 + NTOK unless split
  SLOT      partial-output slot when the plan splits KV, else -1 (write `out` directly)
Items are ordered longest KV range first so the long ones do not finish last.

Split-KV. When too few (q tile, kv head) pairs exist to fill the GPU (a short suffix over a
long prefix, a decode batch), each tile's key range is cut into chunks of whole kv tiles;
every item then writes a partial (O normalised, log2-sum-exp per row) to its slot and a
merge pass combines the slots of each tile (merge list int32 [num_tiles, MERGE_COLS]:
TOK0, NTOK, KV_HEAD, FIRST_SLOT, NUM_SPLITS).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from paged_prefix.metadata import AttentionMetadata

SEQ, TOK0, NTOK, POS0, KV_HEAD, KV_START, KV_END, SLOT = range(8)
WORK_COLS = 8
MERGE_COLS = 5


@dataclass(frozen=True)
class TilePlan:
    """One forward's work list for one (group, kv heads, tile shape) variant."""

    work: mx.array  # int32 [num_items, WORK_COLS]
    merge: mx.array | None  # int32 [num_tiles, MERGE_COLS]; None when nothing is split
    num_items: int
    num_slots: int  # partial slots (== num_items when split, else 0)
    max_rows: int  # most valid rows in one query tile (ntok * group)
    work_host: np.ndarray
    merge_host: np.ndarray | None


def _query_tiles(meta: AttentionMetadata, group: int, num_kv_heads: int, block_m: int):
    """Columns SEQ..KV_HEAD of every (sequence, q tile, kv head), kv heads innermost."""
    tokens_per_tile = block_m // group
    q_lens = meta.q_lens_host.astype(np.int64)
    tiles_per_seq = -(-q_lens // tokens_per_tile)
    seq = np.repeat(np.arange(meta.num_seqs), tiles_per_seq)
    # index of each tile inside its sequence: 0, 1, .. per sequence
    first = np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)
    tok_in_seq = (np.arange(len(seq)) - first) * tokens_per_tile
    ntok = np.minimum(tokens_per_tile, q_lens[seq] - tok_in_seq)
    tok0 = meta.cu_seqlens_q_host[seq] + tok_in_seq
    pos0 = meta.context_lens_host[seq] + tok_in_seq
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
    meta: AttentionMetadata,
    group: int,
    num_kv_heads: int,
    block_m: int,
    block_n: int,
    num_sms: int,
    ctas_per_sm: int = 2,
    min_chunk: int = 2,
    min_items: int | None = None,
) -> TilePlan:
    """The work list (and merge list when KV is split) of one forward; see the module doc.

    KV is split when the plan has fewer than min_items (default num_sms: one per core)
    query tiles, into about num_sms * ctas_per_sm items of >= min_chunk kv tiles each.
    """
    (seq, tok0, ntok, pos0), kv_head = _query_tiles(meta, group, num_kv_heads, block_m)
    kv_end = pos0 + ntok
    kv_tiles = -(-kv_end // block_n)
    min_items = num_sms if min_items is None else min_items
    splits = split_counts(kv_tiles, min_items, num_sms * ctas_per_sm, min_chunk)
    # balanced chunks: split j of a tile covers kv tiles [j*n//k, (j+1)*n//k)
    tile_of_item = np.repeat(np.arange(len(seq)), splits)
    j = np.arange(len(tile_of_item)) - np.repeat(np.cumsum(splits) - splits, splits)
    k = splits[tile_of_item]
    n = kv_tiles[tile_of_item]
    start = (j * n // k) * block_n
    end = np.minimum(((j + 1) * n // k) * block_n, kv_end[tile_of_item])
    is_split = bool((splits > 1).any())
    slot = np.arange(len(tile_of_item)) if is_split else np.full(len(tile_of_item), -1)
    work = np.stack(
        [seq[tile_of_item], tok0[tile_of_item], ntok[tile_of_item], pos0[tile_of_item],
         kv_head[tile_of_item], start, end, slot], axis=1).astype(np.int32)
    work = work[np.argsort(-(work[:, KV_END] - work[:, KV_START]), kind="stable")]
    merge_host = None
    if is_split:
        first_slot = np.cumsum(splits) - splits
        merge_host = np.stack([tok0, ntok, kv_head, first_slot, splits], axis=1).astype(np.int32)
    return TilePlan(
        work=mx.array(work),
        merge=None if merge_host is None else mx.array(merge_host),
        num_items=len(work),
        num_slots=len(work) if is_split else 0,
        max_rows=int(ntok.max()) * group,
        work_host=work,
        merge_host=merge_host,
    )


def merge_partials(o_part: mx.array, lse_part: mx.array, plan: TilePlan, out_shape, dtype,
                   group: int) -> mx.array:
    """MLX-ops merge of split partials, for backends without a merge kernel (and as its oracle).

    o_part [num_slots, block_m, D] float32 (normalised per split), lse_part [num_slots, block_m]
    float32 log2-sum-exp (-inf where a split saw no key). Returns out [T, H, D] in dtype.
    """
    m = plan.merge_host
    _, block_m, head_dim = o_part.shape
    num_tokens, num_heads, _ = out_shape
    max_splits = int(m[:, 4].max())
    # slots[t, j]: slot of split j of tile t, padded with -1 past its split count
    j = np.arange(max_splits)[None, :]
    slots = np.where(j < m[:, 4:5], m[:, 3:4] + j, -1)
    lse = mx.where(mx.array(slots >= 0)[..., None], lse_part[mx.array(np.maximum(slots, 0))],
                   -mx.inf)  # [tiles, splits, block_m]
    top = mx.max(lse, axis=1, keepdims=True)
    w = mx.power(2.0, lse - mx.where(top == -mx.inf, 0, top))
    w = w / mx.sum(w, axis=1, keepdims=True)
    o = mx.sum(o_part[mx.array(np.maximum(slots, 0))] * w[..., None], axis=1)  # [tiles, bm, D]
    # scatter the valid rows of every tile to (token, head)
    r = np.arange(block_m)
    valid = r[None, :] < (m[:, 1:2] * group)
    tile_idx, row = np.nonzero(valid)
    token = m[tile_idx, 0] + row // group
    head = m[tile_idx, 2] * group + row % group
    flat = mx.zeros((num_tokens * num_heads, head_dim), dtype=mx.float32)
    flat[mx.array(token * num_heads + head)] = o[mx.array(tile_idx), mx.array(row)]
    return flat.reshape(out_shape).astype(dtype)
