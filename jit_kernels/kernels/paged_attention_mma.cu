// Paged attention on tensor cores through mma.sync (sm_80 and later): one work item of
// plan.py's work list per threadblock, prefill and decode rows alike, K/V read from the paged
// cache through the block table. The body of an `mx.fast.cuda_kernel`, which writes the
// signature (inputs, then q_shape and block_tables_shape, then outputs) and the template
// constants.
//
// Inputs:  q [T, H, D] T; k_cache, v_cache [num_blocks, BS, Hkv, D] T, or the same bytes in
//          any dtype (a PagedKVCache's 4-byte words, passed as stored);
//          block_tables [S, max_blocks] int32; work [num_items, WORK_COLS] int32 (plan.py);
//          counters int32 [2 num_tiles], zero between launches (split_merge.inc);
//          after: never read, an output of the last launch that took the same counters, so
//          that MLX runs the two in order (it orders the launches of one evaluation only by
//          the buffers they share); sinks [H] float32, one logit per query head (SINKS only).
// Outputs: out [T, H, D] T; o_part [slots, BLOCK_M, D] float32, lse_part [slots, BLOCK_M]
//          float32: the split tiles' scratch (split_merge.inc).
// Grid:    a threadblock of 32 BLOCK_M / WARP_M threads (a warp per WARP_M rows) per item.
// Template: T (__nv_bfloat16 or __half), HEAD_DIM, GROUP, BLOCK_M, WARP_M (16 or 32),
//          STAGES, BS (block size, a power of two), QK_SCALE_BITS (the float32 bits of
//          scale * log2(e)); with SOFTCAP, CAP_IN_BITS and CAP_OUT_BITS (softmax.cuh's Logits).
//          Injected: BLOCK_N keys per K/V tile, PAD, MERGE_ROWS, W_ columns (W_WINDOW with
//          WINDOW), the features WINDOW, SOFTCAP, SINKS (0 or 1: softmax.cuh).
// Smem:    STAGES K/V stages [K][V], each [BLOCK_N][HEAD_DIM + PAD], then Q [BLOCK_M][HEAD_DIM +
//          PAD] when WARP_M = 32 (a warp re-reads its Q fragments every tile: the registers hold
//          two m16 tiles' accumulators instead); with WARP_M = 16, Q passes through the last
//          stage on its way to registers. A warp of 32 rows runs two m16 tiles against each K/V
//          fragment it loads: half the ldmatrix traffic per product of 16-row warps.
// Sentinels: a work item's SLOT -1: its tile is not split, its rows go to out; lse_part -inf:
//          a split saw no key; keys at or past KV_END, and with a window those below the
//          tile's first visible key (never read: another request's pages may be there), are
//          zero-filled in smem, masked in S.
// Pipeline: STAGES - 1 K/V tiles in flight; one barrier per tile (after the wait, before
//          refilling the stage the previous iteration read). Tiles past the causal frontier,
//          and a window's tiles left of it (the plan's KV_START), are never visited; tiles
//          every row sees skip the mask.
#include "common.cuh"
#include "mma_sync.cuh"
#include "softmax.cuh"

  constexpr int D = HEAD_DIM, LD = D + PAD, CHUNKS = D / 8;   // 16-byte chunks per row
  constexpr int KSTEPS = D / 16, DTILES = D / 8, NTILES = BLOCK_N / 8;
  constexpr int MT = WARP_M / 16;              // m16 tiles per warp
  constexpr int NUM_THREADS = 32 * BLOCK_M / WARP_M, ROWS_PER_PASS = NUM_THREADS / CHUNKS;
  constexpr int BUF = 2 * BLOCK_N * LD;        // one K + V stage
  constexpr int STAGE_BYTES = STAGES * BUF * 2;
  static_assert(MT == 1 || MT == 2, "a warp holds 16 or 32 rows");
  static_assert(MT > 1 || BLOCK_M <= 2 * BLOCK_N, "Q staging fits one K + V stage");
  static_assert((BS & (BS - 1)) == 0, "block size is a power of two");
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);          // stage b: K at sK + b * BUF
  T* sV = sK + BLOCK_N * LD;                   //          V at sV + b * BUF
  T* sQ = sK + (MT > 1 ? STAGES : STAGES - 1) * BUF;  // [BLOCK_M][LD]: own, or the last stage

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
#include "work_item.inc"
  const int H = q_shape[1], HKV = H / GROUP, MAX_BLOCKS = block_tables_shape[1];
  const T* kc = reinterpret_cast<const T*>(k_cache);  // caches may come as stored words
  const T* vc = reinterpret_cast<const T*>(v_cache);
  const int rows = ntok * GROUP;
  const float scale_log2 = __int_as_float(QK_SCALE_BITS);

  // Q tile -> smem; padding rows are zero-filled
  const int ch = tid % CHUNKS;
  for (int r = tid / CHUNKS; r < BLOCK_M; r += ROWS_PER_PASS) {
    const bool ok = r < rows;
    const T* src = q + row_offset<GROUP, D>(tok0, H, kvh, ok ? r : 0);
    cp_async16(smem_addr(sQ + r * LD + ch * 8), src + ch * 8, ok);
  }
  cp_async_commit();

  // K/V tile: each thread resolves the page of each of its rows once (K and V share it);
  // keys at or past kv_end (or below key_lo) are zero-filled so masked P * V stays finite.
  const int* table = block_tables + static_cast<size_t>(seq) * MAX_BLOCKS;
  const size_t row_stride = static_cast<size_t>(HKV) * D;
  const size_t page_stride = row_stride * BS;
  const size_t head_off = static_cast<size_t>(kvh) * D + ch * 8;
  auto load_kv = [&](int n0, int buf) {
    for (int r = tid / CHUNKS; r < BLOCK_N; r += ROWS_PER_PASS) {
      const int key = n0 + r;
#if WINDOW
      const bool ok = key < kv_end && key >= key_lo;
#else
      const bool ok = key < kv_end;
#endif
      const int kk = ok ? key : kv_start;
      const size_t off = static_cast<size_t>(table[kk / BS]) * page_stride +
                         static_cast<size_t>(kk % BS) * row_stride + head_off;
      const int s = buf * BUF + r * LD + ch * 8;
      cp_async16(smem_addr(sK + s), kc + off, ok);
      cp_async16(smem_addr(sV + s), vc + off, ok);
    }
  };
  const int num_tiles = (kv_end - kv_start + BLOCK_N - 1) / BLOCK_N;
  for (int t = 0; t < STAGES - 1; ++t) {  // prologue: one (maybe empty) group per stage
    if (t < num_tiles) load_kv(kv_start + t * BLOCK_N, t);
    cp_async_commit();
  }
  cp_async_wait<STAGES - 1>();  // Q has landed
  __syncthreads();

  // A operand of S = Q K^T: 16-row warps keep their Q fragments in registers
  const bool warp_active = warp * WARP_M < rows;  // warp-uniform: padding warps only load
  auto q_frag = [&](int mt, int ks, uint32_t* a) {
    ldsm_x4(smem_addr(sQ + (warp * WARP_M + mt * 16 + lane % 16) * LD + ks * 16 + (lane / 16) * 8),
            a);
  };
  uint32_t qf[MT == 1 ? KSTEPS : 1][4];
  if constexpr (MT == 1)
    for (int ks = 0; ks < KSTEPS; ++ks) q_frag(0, ks, qf[ks]);

  float o[MT][DTILES][4] = {};
  const int row_lo = warp * WARP_M + lane / 4;  // this thread's rows: row_lo + 16 mt + 8 i
#include "row_state.inc"

  for (int t = 0; t < num_tiles; ++t) {
    const int n0 = kv_start + t * BLOCK_N, buf = t % STAGES;
    cp_async_wait<STAGES - 2>();  // tile t has landed
    // every warp is done with tile t - 1 (and with Q): its stage can be refilled
    __syncthreads();
    const int next = t + STAGES - 1;
    if (next < num_tiles) load_kv(kv_start + next * BLOCK_N, next % STAGES);
    cp_async_commit();
    if (!warp_active) continue;
    const T* k_t = sK + buf * BUF;
    const T* v_t = sV + buf * BUF;
    float s[MT][NTILES][4] = {};
    for (int ks = 0; ks < KSTEPS; ++ks) {  // S = Q K^T
      uint32_t a[MT][4];
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (MT == 1) {
          for (int r = 0; r < 4; ++r) a[0][r] = qf[ks][r];
        } else {
          q_frag(mt, ks, a[mt]);
        }
      }
      for (int np = 0; np < NTILES / 2; ++np) {
        uint32_t b[4];
        ldsm_x4(smem_addr(k_t + (np * 16 + lane % 8 + (lane / 16) * 8) * LD + ks * 16 +
                          ((lane / 8) % 2) * 8), b);
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::run(s[mt][2 * np], a[mt], b[0], b[1]);
          Mma<T>::run(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
    float alpha[MT][2];
    online_softmax(s, m_run, l_run, alpha, pos_row, n0, logits, lane, scale_log2);
    rescale_o(o, alpha);
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {  // O += P V, P re-packed as the A operand
      uint32_t a[MT][4];
      for (int mt = 0; mt < MT; ++mt) p_fragment<T>(a[mt], s[mt], kk);
      for (int dp = 0; dp < DTILES / 2; ++dp) {
        uint32_t b[4];
        ldsm_x4_trans(smem_addr(v_t + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD +
                                dp * 16 + (lane / 16) * 8), b);
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::run(o[mt][2 * dp], a[mt], b[0], b[1]);
          Mma<T>::run(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

#include "split_merge.inc"
