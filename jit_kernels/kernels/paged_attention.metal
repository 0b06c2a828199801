// Paged attention on Apple GPUs through simdgroup 8x8 MMAs: the Metal twin of
// paged_attention_mma.cu (same work list and split plan, same per-item algorithm), one work
// item of plan.py's list per threadgroup. The body of an `mx.fast.metal_kernel`, which writes
// the signature (inputs, then q_shape and block_tables_shape, outputs, thread attributes) and
// the template line. Split tiles are merged by a second launch (split_merge.metal).
//
// Inputs:  q [T, H, D] T; k_cache, v_cache [num_blocks, BS, Hkv, D] T, or the same bytes in
//          any dtype (a PagedKVCache's 4-byte words); block_tables [S, max_blocks] int32
//          (constant when it has under 8 elements); work [num_items, WORK_COLS] int32
//          (plan.py; with WINDOW its W_WINDOW column holds W); qk_scale float32 [1]:
//          scale * log2(e), folded into Q (with SOFTCAP, scale / cap). Per feature: softcap
//          float32 [1] (SOFTCAP: cap * log2(e)); sinks float32 [H] (SINKS: a logit per head).
// Outputs: out [T, H, D] T (unsplit tiles); o_part [slots, BLOCK_Q, D] float32, lse_part
//          [slots, BLOCK_Q] float32: a split's output normalised by its own row sum and its
//          log2-sum-exp (-inf: no key), without the sink (the merge adds it).
// Grid:    a threadgroup of NUM_THREADS (four simdgroups, an 8-row band each) per work item.
// Template: T, HEAD_DIM, GROUP, BS (block size), BN (keys per K/V tile). Injected: BLOCK_Q,
//          NUM_THREADS, WORK_COLS and the W_ columns; the features WINDOW, SOFTCAP and
//          SINKS (0 or 1: a plain variant's preprocessed text is the kernel without them).
// Sentinels: a work item's SLOT -1: its tile is not split, its rows go to out; row_off -1: a
//          key past KV_END, zero-filled; lse_part -inf: a split saw no key.
// Threadgroup memory: K and V tiles [BN][HEAD_DIM + PAD] (16-byte row padding), the page
//          offsets of this tile's keys and the next's, row_off [2][BN] (-1: past the keys).
// Window: row r (position p) sees keys p - W + 1 .. p. Whole kv tiles below the tile's first
//          row's window (kv_lo) are never visited and its keys below kv_lo never read (their
//          pages may be vLLM's null block or another request's): zero-filled like padding.
//          Only tiles on the window's edge or the diagonal are masked per element.
#include "metal_common.h"

  constexpr int D = HEAD_DIM, TD = D / 8, TK = BN / 8;
  constexpr int PAD = 16 / sizeof(T);
  constexpr int LD = D + PAD;  // k_s / v_s row stride
  constexpr int CHUNKS = BN * D / 4;  // 4-element vectors per K (or V) tile
  static_assert(CHUNKS % NUM_THREADS == 0 && BN <= NUM_THREADS, "tile loader shape");
  threadgroup T k_s[BN * LD];
  threadgroup T v_s[BN * LD];
  threadgroup long row_off[2][BN];

  const uint tid = thread_index_in_threadgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  auto item = work + threadgroup_position_in_grid.x * WORK_COLS;
  const int seq = item[W_SEQ], tok0 = item[W_TOK0], ntok = item[W_NTOK], pos0 = item[W_POS0];
#if WINDOW
  const int win = item[W_WINDOW];
  const int kv_lo = max(pos0 - win + 1, 0);  // the first key any row of this tile sees
  // the item's range from the kv tile holding kv_lo: tiles wholly left of it are never read
  const int kvh = item[W_KV_HEAD], kv_start = max(item[W_KV_START], kv_lo / BN * BN);
  const int kv_end = item[W_KV_END];
  const int edge_to = pos0 + ntok - win;  // keys below it are left of some row's window
#else
  const int kvh = item[W_KV_HEAD], kv_start = item[W_KV_START], kv_end = item[W_KV_END];
#endif
  const int slot = item[W_SLOT];
  const int num_heads = q_shape[1];
  const int num_kv_heads = num_heads / GROUP;
  auto kc = (const device T*)k_cache;  // caches may come as stored words
  auto vc = (const device T*)v_cache;
  const int rows = ntok * GROUP;
  auto table = block_tables + long(seq) * block_tables_shape[1];
  const long row_stride = long(num_kv_heads) * D;
  const long head_off = long(kvh) * D;

  // This lane's fragment coordinates (row fm, columns fn and fn + 1 of every 8x8 fragment).
  const int fm = (lane & 16) / 4 + (lane & 6) / 2;
  const int fn = (lane & 8) / 2 + (lane & 1) * 2;
  const int r = sg * 8 + fm;                  // tile row
  const bool row_valid = r < rows;
  const bool sg_active = int(sg) * 8 < rows;  // simdgroup-uniform: idle bands only load
  const int row_pos = pos0 + r / GROUP;       // absolute position: sees keys 0 .. row_pos
#if WINDOW
  const int row_lo = row_pos - win + 1;       // ... from row_lo on
#endif
  const long q_off = (long(tok0 + r / GROUP) * num_heads + kvh * GROUP + r % GROUP) * D + fn;

  simdgroup_float8x8 q_frag[TD], o_acc[TD];
  const float qk = qk_scale[0];
  PP_UNROLL for (int td = 0; td < TD; ++td) {
    float2 v = float2(0.0f);
    if (row_valid) v = float2(float(q[q_off + td * 8]), float(q[q_off + td * 8 + 1])) * qk;
    q_frag[td].thread_elements()[0] = v.x;
    q_frag[td].thread_elements()[1] = v.y;
    o_acc[td] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float m_run = NEG_INF, l_run = 0.0f;  // this row's running max (log2 units) and sum
  // keys < mask_from are visible to every row of the tile: tiles below it skip the mask
  const int mask_from = min(pos0 + 1, kv_end);

  if (tid < BN)
    row_off[0][tid] = pp_row_offset<BS>(table, kv_start + tid, kv_end, row_stride, head_off);
  int buf = 0;
  for (int n0 = kv_start; n0 < kv_end; n0 += BN, buf ^= 1) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // last tile consumed; row_off[buf] ready
    PP_UNROLL for (int i = 0; i < CHUNKS / NUM_THREADS; ++i) {
      const int c = tid + i * NUM_THREADS;
      const int j = c / (D / 4), d = (c % (D / 4)) * 4;
      const long off = row_off[buf][j];
      vec<T, 4> kv = vec<T, 4>(T(0.0f)), vv = vec<T, 4>(T(0.0f));
#if WINDOW
      if (off >= 0 && n0 + j >= kv_lo) {  // zero left of the window too: its pages are not ours
#else
      if (off >= 0) {  // zero past the keys: masked P * V must stay finite
#endif
        kv = *(const device vec<T, 4>*)(kc + off + d);
        vv = *(const device vec<T, 4>*)(vc + off + d);
      }
      PP_UNROLL for (int e = 0; e < 4; ++e) {
        k_s[j * LD + d + e] = kv[e];
        v_s[j * LD + d + e] = vv[e];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tile visible to every simdgroup
    // next tile's pages, resolved once per row while this one computes (other buffer)
    if (tid < BN)
      row_off[buf ^ 1][tid] = pp_row_offset<BS>(table, n0 + BN + tid, kv_end, row_stride, head_off);
    if (!sg_active) continue;

    simdgroup_float8x8 s_acc[TK];  // S = (Q * scale * log2 e) K^T, 8 rows x BN keys
    PP_UNROLL for (int tk = 0; tk < TK; ++tk)
      s_acc[tk] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    PP_UNROLL for (int td = 0; td < TD; ++td) {
      PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
        const threadgroup T* src = k_s + (tk * 8 + fn) * LD + td * 8 + fm;  // K^T[d][key]
        simdgroup_float8x8 k_frag;
        k_frag.thread_elements()[0] = float(src[0]);
        k_frag.thread_elements()[1] = float(src[LD]);
        simdgroup_multiply_accumulate(s_acc[tk], q_frag[td], k_frag, s_acc[tk]);
      }
    }
#if SOFTCAP
    // S holds scale * q.k / cap: cap * tanh(.) in natural units (softcap[0] = cap * log2 e
    // takes it to log2 units), before the max sees it
    PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
      s_acc[tk].thread_elements()[0] = softcap[0] * tanh(s_acc[tk].thread_elements()[0]);
      s_acc[tk].thread_elements()[1] = softcap[0] * tanh(s_acc[tk].thread_elements()[1]);
    }
#endif
#if WINDOW
    if (n0 + BN > mask_from || n0 < edge_to) {  // the diagonal's or the window's edge
#else
    if (n0 + BN > mask_from) {  // diagonal, split-edge or last tile: mask by position
#endif
      PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
        PP_UNROLL for (int e = 0; e < 2; ++e) {
          const int key = n0 + tk * 8 + fn + e;
          if (key > row_pos || key >= kv_end) s_acc[tk].thread_elements()[e] = NEG_INF;
#if WINDOW
          if (key < row_lo) s_acc[tk].thread_elements()[e] = NEG_INF;
#endif
        }
      }
    }
    // Online softmax; the 4 lanes of a row differ in lane bits 0 and 3.
    float m_new = m_run;
    PP_UNROLL for (int tk = 0; tk < TK; ++tk)
      m_new = max(m_new, max(s_acc[tk].thread_elements()[0], s_acc[tk].thread_elements()[1]));
    m_new = max(m_new, simd_shuffle_xor(m_new, ushort(1)));
    m_new = max(m_new, simd_shuffle_xor(m_new, ushort(8)));
    const float base = m_new == NEG_INF ? 0.0f : m_new;  // no visible key yet: no NaN
    const float alpha = exp2(m_run - base);
    float sum = 0.0f;
    PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
      PP_UNROLL for (int e = 0; e < 2; ++e) {
        const float p = exp2(s_acc[tk].thread_elements()[e] - base);
        s_acc[tk].thread_elements()[e] = p;
        sum += p;
      }
    }
    sum += simd_shuffle_xor(sum, ushort(1));
    sum += simd_shuffle_xor(sum, ushort(8));
    l_run = l_run * alpha + sum;
    m_run = m_new;
    PP_UNROLL for (int td = 0; td < TD; ++td) {  // O = alpha O + P V (P stays fp32)
      o_acc[td].thread_elements()[0] *= alpha;
      o_acc[td].thread_elements()[1] *= alpha;
      PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
        const threadgroup T* src = v_s + (tk * 8 + fm) * LD + td * 8 + fn;  // V[key][d]
        simdgroup_float8x8 v_frag;
        v_frag.thread_elements()[0] = float(src[0]);
        v_frag.thread_elements()[1] = float(src[1]);
        simdgroup_multiply_accumulate(o_acc[td], s_acc[tk], v_frag, o_acc[td]);
      }
    }
  }

  if (!row_valid) return;
#if SINKS
  if (slot < 0) {  // the sink joins the max and the sum once per row: a split's in the merge
    const float sink = sinks[kvh * GROUP + r % GROUP] * M_LOG2E_F;
    const float top = max(m_run, sink);
    const float rescale = exp2(m_run - top);
    l_run = l_run * rescale + exp2(sink - top);
    PP_UNROLL for (int td = 0; td < TD; ++td) {
      o_acc[td].thread_elements()[0] *= rescale;
      o_acc[td].thread_elements()[1] *= rescale;
    }
  }
#endif
  const float inv = l_run > 0.0f ? 1.0f / l_run : 0.0f;
  if (slot < 0) {
    device T* dst = out + q_off;
    PP_UNROLL for (int td = 0; td < TD; ++td) {
      dst[td * 8] = T(o_acc[td].thread_elements()[0] * inv);
      dst[td * 8 + 1] = T(o_acc[td].thread_elements()[1] * inv);
    }
  } else {
    device float* dst = o_part + (long(slot) * BLOCK_Q + r) * D + fn;
    PP_UNROLL for (int td = 0; td < TD; ++td) {
      dst[td * 8] = o_acc[td].thread_elements()[0] * inv;
      dst[td * 8 + 1] = o_acc[td].thread_elements()[1] * inv;
    }
    if (fn == 0) lse_part[long(slot) * BLOCK_Q + r] = l_run > 0.0f ? m_run + log2(l_run) : NEG_INF;
  }
