// The merge of split tiles' partials on Apple GPUs: the second launch of a split plan of
// paged_attention.metal (merging inside the attention launch needs a device-scope
// release/acquire between threadgroups, which MSL offers only from Metal 3.2 on). The body of
// an `mx.fast.metal_kernel`.
//
// Inputs:  o_part, lse_part: the attention launch's; merge [num_tiles, MERGE_COLS] int32
//          (plan.py; constant when it has under 8 elements); attn_out [T, H, D] T: the
//          attention launch's `out`, final for unsplit tiles (their sinks included); with
//          SINKS, sinks float32 [H]: a split row's sink joins its max and sum here, once.
// Output:  out [T, H, D] T.
// Grid:    a threadgroup of NUM_THREADS per tile; a simdgroup per row, columns lane + 32 j.
//          An unsplit tile (FIRST_SLOT -1) only copies its rows over: outputs start
//          uninitialised.
// Template: T, HEAD_DIM, GROUP, NUM_HEADS. Injected: BLOCK_Q, NUM_THREADS, MERGE_COLS, the
//          M_ columns and SINKS (0 or 1).
#include "metal_common.h"

  constexpr int D = HEAD_DIM, PER_LANE = D / 32;
  const uint sg = simdgroup_index_in_threadgroup, lane = thread_index_in_simdgroup;
  auto item = merge + threadgroup_position_in_grid.x * MERGE_COLS;  // constant if < 8 ints
  const int tok0 = item[M_TOK0], ntok = item[M_NTOK], kvh = item[M_KV_HEAD];
  const int first = item[M_FIRST_SLOT], nsplit = item[M_NUM_SPLITS];
  for (int row = sg; row < ntok * GROUP; row += NUM_THREADS / 32) {
    const long dst_off = (long(tok0 + row / GROUP) * NUM_HEADS + kvh * GROUP + row % GROUP) * D;
    device T* dst = out + dst_off;
    if (first < 0) {
      PP_UNROLL for (int j = 0; j < PER_LANE; ++j) dst[lane + 32 * j] = attn_out[dst_off + lane + 32 * j];
      continue;
    }
    float top = NEG_INF;
    for (int s = 0; s < nsplit; ++s) top = max(top, lse_part[long(first + s) * BLOCK_Q + row]);
#if SINKS
    const float sink = sinks[kvh * GROUP + row % GROUP] * M_LOG2E_F;  // a weight, no value
    top = max(top, sink);
#endif
    const float base = top == NEG_INF ? 0.0f : top;
    float acc[PER_LANE] = {0.0f}, sum = 0.0f;
#if SINKS
    sum = exp2(sink - base);
#endif
    for (int s = 0; s < nsplit; ++s) {
      const long part = long(first + s) * BLOCK_Q + row;
      const float w = exp2(lse_part[part] - base);
      sum += w;
      PP_UNROLL for (int j = 0; j < PER_LANE; ++j) acc[j] += w * o_part[part * D + lane + 32 * j];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    PP_UNROLL for (int j = 0; j < PER_LANE; ++j) dst[lane + 32 * j] = T(acc[j] * inv);
  }
