// Long prefills over cached prefixes on Hopper (sm_90a, compiled by NVRTC): a warp-specialized
// kernel that loads K/V pages with TMA. A threadblock of three warpgroups takes one work item
// of an unsplit 128-row plan: 128 query rows of one kv head, all their keys (KV_START = 0, or
// with a window the KV_TILE holding the tile's first visible key).
// - the producer's first warp loads each K/V tile of KV_TILE keys page by page: a lane per K
//   box (half a page), a lane per V box (a page), each lane holding its page's block id one
//   tile ahead, into a ring of STAGES stages;
// - two consumer warpgroups of 64 rows issue S of tile t + 1 and O += P V of tile t together,
//   and run the softmax of t + 1 while P V runs; K's slot is released as soon as S is done;
// - setmaxnreg moves registers from the producer to the consumers.
//
// Inputs:  q [T, H, 128] T; k_cache, v_cache (rows of [Hkv, 128], 16-bit, any dtype);
//          block_tables [S, MAX_BLOCKS] int32; work [items, WORK_COLS] int32 (plan.py);
//          tmaps uint8 [256]: the K and V map templates of these caches (tma.py);
//          sinks [H] float32, one logit per query head (SINKS only).
// Outputs: out [T, H, 128] T (rows of sequences the plan leaves out are not written);
//          maps uint8 [items * 256]: each block's K and V maps, patched with the caches'
//          addresses.
// Scalars: H (query heads), MAX_BLOCKS (block_tables' width).
// Grid:    one block of NUM_THREADS (384) per work item.
// Compile-time: T, AB, HEAD_DIM (128), GROUP, BS (8, 16 or 32), BLOCK_M (128), KV_TILE, STAGES,
//          QK_SCALE_BITS, NUM_THREADS, PRODUCER_REGS, CONSUMER_REGS, KERNEL_NAME; W_ columns;
//          the features WINDOW, SOFTCAP (with CAP_IN_BITS, CAP_OUT_BITS), SINKS (softmax.cuh).
// Sentinels: the padding rows of a tile (past NTOK * GROUP) are zero rows of Q, never stored;
//          the last tile's V rows past KV_END hold other pages' data and are zeroed; with a
//          window, a first tile's pages wholly left of its first visible key are never read:
//          their slots take that key's page again (masked out, their V rows zeroed).
// Smem (1024-byte aligned; the launch asks for 1024 bytes of slack): STAGES x [K tile
//          [2][KV_TILE][64]][V tile: per page [2][BS][64]], swizzled; a K slot and a V slot each
//          have a "full" barrier (the producer's loads) and an "empty" one (every consumer
//          thread arrives).
#include "nvrtc.cuh"
#include "common.cuh"
#include "wgmma.cuh"
#include "softmax.cuh"
#include "tma.cuh"

// The descriptor of k-step kk of the V tile at v_t: V lands a page at a time as [2][BS][64],
// so a k-step's 16 keys start at their page's slot (BS >= 16) or span two (BS = 8: 8-row
// groups a page apart), and the two 64-column halves of a page are BS rows apart.
__device__ __forceinline__ uint64_t paged_v_desc(uint32_t v_t, int kk) {
  return smem_desc(v_t + (kk * 16 / BS) * BS * 256 + (kk * 16 % BS) * 128, BS * 128,
                   BS == 8 ? 2 * GROUP_BYTES : GROUP_BYTES);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
KERNEL_NAME(const T* q, const T* k_cache, const T* v_cache, const int* block_tables,
            const int* work, const unsigned char* tmaps,
#if SINKS
            const float* sinks,
#endif
            T* out, unsigned char* maps, int H, int MAX_BLOCKS) {
  constexpr int D = HEAD_DIM, KSTEPS = D / 16, DTILES = D / 8, NTILES = KV_TILE / 8, MT = 1;
  constexpr int HALF = KV_TILE * 64, TILE = KV_TILE * D;
  constexpr int PAGE_BYTES = BS * 256, PAGES_PER_TILE = KV_TILE / BS;
  static_assert(D == 128 && KV_TILE % BS == 0 && BS % 8 == 0, "boxes of whole swizzle atoms");
  static_assert(BLOCK_M == 2 * 64 && NUM_THREADS == 3 * 128, "a producer, two consumers of 64 rows");
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem + ((1024 - (smem_addr(smem) & 1023)) & 1023));
  __shared__ __align__(128) unsigned char maps_s[2][128];
  __shared__ __align__(8) uint64_t full_k[STAGES], full_v[STAGES], empty_v[STAGES],
      empty_k[STAGES];

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int* item = work + static_cast<size_t>(blockIdx.x) * WORK_COLS;
  const int seq = item[W_SEQ], tok0 = item[W_TOK0], ntok = item[W_NTOK], pos0 = item[W_POS0];
  const int kvh = item[W_KV_HEAD], kv_start = item[W_KV_START], kv_end = item[W_KV_END];
  const int rows = ntok * GROUP;
  const int num_tiles = (kv_end - kv_start + KV_TILE - 1) / KV_TILE;
#if WINDOW
  const int key_lo = max(pos0 - item[W_WINDOW] + 1, 0);  // the tile's first visible key
#endif
  unsigned char* maps_g = maps + static_cast<size_t>(blockIdx.x) * 256;

  if (tid < 32) {  // the block's K and V maps: the templates, with the caches' addresses
    const void* const bases[2] = {k_cache, v_cache};
    publish_maps<2>(lane, tmaps, bases, maps_s, maps_g);
    acquire_maps<2>(maps_g);  // every lane loads through them
    if (lane == 0) {
      for (int st = 0; st < STAGES; ++st) {
        mbar_init(smem_addr(&full_k[st]), 1);
        mbar_init(smem_addr(&full_v[st]), 1);
        mbar_init(smem_addr(&empty_v[st]), 256);  // every consumer thread
        mbar_init(smem_addr(&empty_k[st]), 256);
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
  }
  __syncthreads();

  if (wg == 0) {  // producer: warp 0; lane 2p + h loads half h of page p's K, lane p its V
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGS));
    if (tid < 32) {
      const int* table = block_tables + static_cast<size_t>(seq) * MAX_BLOCKS;
      const int p = lane / 2, h = lane % 2;
      // the block id of page p of a tile at key n0, read a tile ahead of its loads (between a
      // slot's release and its loads the table read cost time: docs/kernels.md, "The prefill
      // kernel (Hopper, TMA)")
      auto block_of = [&](int n0) {
#if WINDOW
        const int page = max(n0 / BS + p, key_lo / BS);  // never a page left of the window
#else
        const int page = n0 / BS + p;
#endif
        return lane < 2 * PAGES_PER_TILE && n0 + p * BS < kv_end ? table[page] : 0;
      };
      int next = block_of(kv_start);
      for (int t = 0; t < num_tiles; ++t) {
        const int stage = t % STAGES, phase = (t / STAGES) & 1;
        const int n0 = kv_start + t * KV_TILE;
        const int pages = min(PAGES_PER_TILE, (kv_end - n0 + BS - 1) / BS);
        const int block = next;
        if (t + 1 < num_tiles) next = block_of(n0 + KV_TILE);
        const uint32_t k_dst = smem_addr(sK + 2 * stage * TILE), v_dst = k_dst + TILE * 2;
        // K's slot frees once S is done, before V's
        mbar_wait(smem_addr(&empty_k[stage]), phase ^ 1);
        if (lane == 0) mbar_expect(smem_addr(&full_k[stage]), pages * PAGE_BYTES);
        __syncwarp();
        if (lane < 2 * pages)
          tma_load(k_dst + (h * HALF + p * BS * 64) * 2, maps_g, h * 64, kvh, block * BS,
                   smem_addr(&full_k[stage]));
        const int v_block = __shfl_sync(0xffffffff, block, (2 * lane) % 32);  // page `lane`'s
        mbar_wait(smem_addr(&empty_v[stage]), phase ^ 1);
        if (lane == 0) mbar_expect(smem_addr(&full_v[stage]), pages * PAGE_BYTES);
        __syncwarp();
        if (lane < pages)
          tma_load4(v_dst + lane * PAGE_BYTES, maps_g + 128, 0, v_block * BS, 0, kvh,
                    smem_addr(&full_v[stage]));
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(CONSUMER_REGS));

  const int row_lo = (wg - 1) * 64 + warp * 16 + lane / 4;
  const float scale_log2 = __int_as_float(QK_SCALE_BITS);
  uint32_t qf[KSTEPS][4];
  load_q_fragments<GROUP>(qf, q, tok0, H, kvh, row_lo, rows, lane);
#include "row_state.inc"

  // V rows of a stage's tile whose keys the item does not read hold other data: past kv_end
  // another page's rows, below a window's first visible key that key's page again (its rows
  // past the sequence's end included). P is 0 there; V is made 0 too, for both consumers.
  auto clear_v = [&](int stage, int n0) {
    T* v_s = sK + (2 * stage + 1) * TILE;
    for (int i = tid - 128; i < KV_TILE * 16; i += 256) {
      const int r = i / 16, c = i % 16;  // key r of the tile, 16-byte chunk c of its row
#if WINDOW
      if (n0 + r >= kv_end || n0 + r < key_lo)
#else
      if (n0 + r >= kv_end)
#endif
        *reinterpret_cast<uint4*>(v_s + (r / BS) * BS * 128 + (c / 8) * BS * 64 +
                                  (r % BS) * 64 + (c % 8) * 8) = make_uint4(0u, 0u, 0u, 0u);
    }
    fence_async_smem();
    asm volatile("bar.sync 1, 256;" ::: "memory");
  };

  float s[MT][NTILES][4];
  uint32_t p[KV_TILE / 16][4];
  {  // S of the first tile, its softmax and P
    const int n0 = kv_start;
    const uint32_t k_t = smem_addr(sK);
    mbar_wait(smem_addr(&full_k[0]), 0);
    s_issue(s, qf, k_t);
    wgmma_wait<0>();
    pin(s);
    mbar_arrive(smem_addr(&empty_k[0]));
    float alpha[MT][2];  // O is zero: nothing to rescale
    online_softmax(s, m_run, l_run, alpha, pos_row, n0, logits, lane, scale_log2);
    pack_p<T>(p, s[0]);
  }
  for (int t = 0; t + 1 < num_tiles; ++t) {  // S of tile t + 1 and O += P V of tile t at once
    const int stage = t % STAGES, phase = (t / STAGES) & 1;
    const int nstage = (t + 1) % STAGES, nphase = ((t + 1) / STAGES) & 1;
    const uint32_t v_t = smem_addr(sK + (2 * stage + 1) * TILE);
    const uint32_t k_t = smem_addr(sK + 2 * nstage * TILE);
    const int n0 = kv_start + (t + 1) * KV_TILE;
    mbar_wait(smem_addr(&full_v[stage]), phase);
    mbar_wait(smem_addr(&full_k[nstage]), nphase);
#if WINDOW
    if (t == 0 && kv_start < key_lo) clear_v(stage, kv_start);
#endif
    s_issue(s, qf, k_t);
    pv_issue(o, p, [&](int kk) { return paged_v_desc(v_t, kk); });
    wgmma_wait<1>();  // S is done: its softmax runs while the tensor cores do P V
    pin(s);
    mbar_arrive(smem_addr(&empty_k[nstage]));
    float alpha[MT][2];
    online_softmax(s, m_run, l_run, alpha, pos_row, n0, logits, lane, scale_log2);
    wgmma_wait<0>();
    pin(o);
    mbar_arrive(smem_addr(&empty_v[stage]));
    rescale_o(o, alpha);
    pack_p<T>(p, s[0]);
  }
  {  // O += P V of the last tile
    const int t = num_tiles - 1, stage = t % STAGES, phase = (t / STAGES) & 1;
    const int n0 = kv_start + t * KV_TILE;
    const uint32_t v_t = smem_addr(sK + (2 * stage + 1) * TILE);
    mbar_wait(smem_addr(&full_v[stage]), phase);
#if WINDOW
    if (n0 + KV_TILE > kv_end || n0 < key_lo) clear_v(stage, n0);
#else
    if (n0 + KV_TILE > kv_end) clear_v(stage, n0);
#endif
    wgmma_fence();
    pv_issue(o, p, [&](int kk) { return paged_v_desc(v_t, kk); });
    wgmma_wait<0>();
    pin(o);
  }

  for (int i = 0; i < 2; ++i) {
    const int row = row_lo + 8 * i;
#if SINKS
    const float l = with_sink(row_sum(l_run[0][i]), m_run[0][i] * scale_log2,
                              sinks[kvh * GROUP + row % GROUP]);
#else
    const float l = row_sum(l_run[0][i]);
#endif
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (row >= rows) continue;
    store_row(out + row_offset<GROUP, D>(tok0, H, kvh, row), o[0], i, inv, lane);
  }
}
