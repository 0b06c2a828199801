// Paged attention on Hopper warpgroup MMAs (sm_90a, compiled by NVRTC): the mma.sync
// kernel's contract, plan, work list and split merge (paged_attention_mma.cu), with the tile
// products of wgmma.cuh. A threadblock is one warpgroup of 64 query rows; S = Q K^T and
// O += P V read K and V straight from shared memory, where the mma.sync kernel has every warp
// load every K/V fragment for its own 16 rows: a quarter of the shared-memory traffic.
//
// Inputs, outputs, grid: as paged_attention_mma.cu's (BLOCK_M = 64, WARP_M = 16; sinks with
//          SINKS only), then the scalars H (query heads) and MAX_BLOCKS (block_tables' width).
// Compile-time: T (16-bit storage), AB ("bf16" / "f16"), HEAD_DIM (128), GROUP,
//          BS, QK_SCALE_BITS, STAGES, BLOCK_M (64), NUM_THREADS (128: one warpgroup),
//          MIN_BLOCKS_PER_SM, KERNEL_NAME; BLOCK_N, MERGE_ROWS and the W_ columns; the features
//          WINDOW, SOFTCAP (with CAP_IN_BITS, CAP_OUT_BITS), SINKS (softmax.cuh).
// Smem (1024-byte aligned; the launch asks for 1024 bytes of slack): STAGES x [K tile][V tile],
//          each [HEAD_DIM / 64][BLOCK_N][64] in the 128-byte swizzle: 16-byte chunk c of key row
//          r at chunk c ^ (r % 8). K is the B operand K-major (keys are its N), V the B operand
//          N-major (transposed: keys are its K).
// Sentinels: as paged_attention_mma.cu's (a window's keys below the tile's first visible key
//          zero-filled, never read, as those past KV_END); the padding rows of a tile (past NTOK * GROUP) take
//          part in the warpgroup MMAs as zero rows of Q and are never stored.
// Pipeline: STAGES - 1 K/V tiles in flight; per tile one barrier, then S by HEAD_DIM / 16
//          m64nBLOCK_Nk16 wgmmas, the next tile's loads issued while they run, the softmax in
//          registers, and O by BLOCK_N / 16 m64n128k16 wgmmas.
#include "nvrtc.cuh"
#include "common.cuh"
#include "wgmma.cuh"
#include "softmax.cuh"

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_PER_SM)
KERNEL_NAME(const T* q, const T* k_cache, const T* v_cache, const int* block_tables,
            const int* work, const int* counters, const int* after,
#if SINKS
            const float* sinks,
#endif
            T* out, float* o_part, float* lse_part, int H, int MAX_BLOCKS) {
  constexpr int D = HEAD_DIM, CHUNKS = D / 8, KSTEPS = D / 16, DTILES = D / 8, NTILES = BLOCK_N / 8;
  constexpr int MT = 1, ROWS_PER_PASS = NUM_THREADS / CHUNKS;
  constexpr int HALF = BLOCK_N * 64, TILE = BLOCK_N * D;  // elements: a 64-column block, a tile
  constexpr int STAGE_BYTES = 2 * STAGES * TILE * 2;
  static_assert(D % 64 == 0, "whole 128-byte swizzle rows");
  // a key tile starts a page (KV_START is a multiple of BLOCK_N); a load pass stays in one page
  static_assert(BLOCK_N % BS == 0 && BS % ROWS_PER_PASS == 0, "pages and load passes nest");
  extern __shared__ __align__(16) unsigned char smem[];
  // swizzle atoms start on 1024-byte boundaries
  T* sK = reinterpret_cast<T*>(smem + ((1024 - (smem_addr(smem) & 1023)) & 1023));

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
#include "work_item.inc"
  const int HKV = H / GROUP;
  const T* kc = reinterpret_cast<const T*>(k_cache);  // caches may come as stored words
  const T* vc = reinterpret_cast<const T*>(v_cache);
  const int rows = ntok * GROUP;
  const float scale_log2 = __int_as_float(QK_SCALE_BITS);
  const bool warp_active = true;  // a warpgroup MMA takes all four warps, padding rows too

  const int ch = tid % CHUNKS;
  const int* table = block_tables + static_cast<size_t>(seq) * MAX_BLOCKS;
  const size_t row_stride = static_cast<size_t>(HKV) * D;
  const size_t page_stride = row_stride * BS;
  const size_t head_off = static_cast<size_t>(kvh) * D + ch * 8;
  // swizzled smem offset of this thread's chunk in key row r of a tile
  auto chunk_at = [&](int r) { return (ch / 8) * HALF + r * 64 + ((ch % 8) ^ (r % 8)) * 8; };
  auto load_kv = [&](int n0, int buf) {
#pragma unroll
    for (int pass = 0; pass < BLOCK_N / ROWS_PER_PASS; ++pass) {
      const int r = tid / CHUNKS + pass * ROWS_PER_PASS, key = n0 + r;
#if WINDOW
      const bool ok = key < kv_end && key >= key_lo;  // as the mma.sync kernel's
#else
      const bool ok = key < kv_end;
#endif
      // a pass's rows share one page: one broadcast table load (measured faster where three
      // blocks share an SM, slower one call at a time at short splits: docs/kernels.md, "The
      // paged kernel on Hopper: wgmma")
      const int first = n0 + pass * ROWS_PER_PASS;
      const size_t off =
          static_cast<size_t>(table[(first < kv_end ? first : kv_start) / BS]) * page_stride +
          static_cast<size_t>(first % BS + tid / CHUNKS) * row_stride + head_off;
      const int s = 2 * buf * TILE + chunk_at(r);
      cp_async16(smem_addr(sK + s), kc + off, ok);
      cp_async16(smem_addr(sK + s + TILE), vc + off, ok);
    }
  };
  const int num_tiles = (kv_end - kv_start + BLOCK_N - 1) / BLOCK_N;
  for (int t = 0; t < STAGES - 1; ++t) {
    if (t < num_tiles) load_kv(kv_start + t * BLOCK_N, t);
    cp_async_commit();
  }

  const int row_lo = warp * 16 + lane / 4;
  uint32_t qf[KSTEPS][4];
  load_q_fragments<GROUP>(qf, q, tok0, H, kvh, row_lo, rows, lane);
  float o[MT][DTILES][4] = {};
#include "row_state.inc"

  for (int t = 0; t < num_tiles; ++t) {
    const int n0 = kv_start + t * BLOCK_N, buf = t % STAGES;
    cp_async_wait<STAGES - 2>();  // tile t has landed (this thread's part) ...
    fence_async_smem();           // ... visible to the tensor cores ...
    __syncthreads();              // ... every thread's part; tile t - 1 read by every warp
    const uint32_t k_t = smem_addr(sK + 2 * buf * TILE), v_t = k_t + TILE * 2;

    float s[MT][NTILES][4];
    s_issue(s, qf, k_t);
    // the next tile's loads issue while the tensor cores work on S
    const int next = t + STAGES - 1;
    if (next < num_tiles) load_kv(kv_start + next * BLOCK_N, next % STAGES);
    cp_async_commit();
    wgmma_wait<0>();
    pin(s);
    float alpha[MT][2];
    online_softmax(s, m_run, l_run, alpha, pos_row, n0, logits, lane, scale_log2);
    rescale_o(o, alpha);
    uint32_t p[BLOCK_N / 16][4];  // P as the A operand, 16 keys per k-step
    pack_p<T>(p, s[0]);
    wgmma_fence();
    pv_issue(o, p, [&](int kk) {  // V's 64-column blocks HALF apart
      return smem_desc(v_t + kk * 2 * GROUP_BYTES, HALF * 2, GROUP_BYTES);
    });
    wgmma_wait<0>();
    pin(o);
  }

#include "split_merge.inc"
}
