// The end of a paged-attention work item, for the mma.sync and wgmma kernels: its rows
// normalised and stored, and the merge of a split tile's partials inside the same launch.
//
// An unsplit tile (slot < 0) writes out [T, H, D] directly. A split writes its partial, O
// normalised by its own row sum, to o_part [slots, BLOCK_M, D] float32 and its log2-sum-exp to
// lse_part [slots, BLOCK_M] float32 (-inf: no key); the last split of the tile to arrive
// merges the tile's partials by log-sum-exp into out. It keeps its own partial on chip, in the
// K/V stages (free by then: STAGE_BYTES of them, rows padded so that the accumulator layout's
// stores spread over the banks), so a tile of n splits stores and reads back n - 1 partials.
// Whichever split is last, the merge reads the parts in slot order and the same fp32 values:
// bitwise the same output.
//
// counters: int32, two a tile, zero between launches: counters[2 tile] counts the splits'
// arrivals (tickets taken before the stores), counters[2 tile + 1] the partials stored; the
// last split resets both, so one array serves launch after launch.
// Needs MERGE_ROWS (rows a thread merges at once), plan.py's W_ columns and Mma<T>::pack.
#include "common.cuh"
#include "softmax.cuh"

// The merge, by the tile's last split, of the nsplit partials in slots first.. (its own, slot
// first + own, staged in shared memory) into out. A warp reads whole rows of a partial (a
// lane per float4 column: 16-lane rows at D = 64), each thread MERGE_ROWS rows at once, so one
// split's loads of all of them are in flight together; rows rescale online, with no pass for
// their maxima first. (Measured faster than two threads a row, each reading half of it:
// docs/gpu.md.)
template <int GROUP, int D, int BLOCK_M, int NUM_THREADS, int STAGE_LD, typename T>
__device__ __forceinline__ void merge_partials(T* out, const float* o_part, const float* lse_part,
                                               const float* staged, int first, int own, int nsplit,
                                               int rows, int tid, int tok0, int H, int kvh) {
  constexpr int LANES_PER_ROW = D / 4, ROW_STEP = NUM_THREADS / LANES_PER_ROW;
  constexpr int RB = BLOCK_M / ROW_STEP < MERGE_ROWS ? BLOCK_M / ROW_STEP : MERGE_ROWS;
  const int c4 = tid % LANES_PER_ROW;
  // other blocks wrote these through L2: relaxed loads never take them from this SM's L1
  const float* lse = lse_part + static_cast<size_t>(first) * BLOCK_M;
  const float4* part = reinterpret_cast<const float4*>(o_part) +
                       static_cast<size_t>(first) * BLOCK_M * LANES_PER_ROW + c4;
  const float* own_lse = staged + BLOCK_M * STAGE_LD;
  const float4* own_part = reinterpret_cast<const float4*>(staged) + c4;
  for (int r0 = tid / LANES_PER_ROW; r0 < rows; r0 += RB * ROW_STEP) {
    float4 acc[RB];
    float m[RB], l[RB];
    for (int j = 0; j < RB; ++j) {
      acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      m[j] = -INFINITY;
      l[j] = 0.f;
    }
    for (int s = 0; s < nsplit; ++s) {
      float ls[RB];
      float4 x[RB];
      const bool mine = s == own;  // warp-uniform
      const float* lse_s = mine ? own_lse : lse + static_cast<size_t>(s) * BLOCK_M;
      const float4* part_s = mine ? own_part : part + static_cast<size_t>(s) * BLOCK_M * LANES_PER_ROW;
      const int row_step = mine ? STAGE_LD / 4 : LANES_PER_ROW;
#pragma unroll
      for (int j = 0; j < RB; ++j) {
        const int row = r0 + j * ROW_STEP, r = row < rows ? row : 0;
        ls[j] = row < rows ? load_relaxed(lse_s + r) : -INFINITY;
        x[j] = load_relaxed(part_s + r * row_step);
      }
#pragma unroll
      for (int j = 0; j < RB; ++j) {
        const float top = fmaxf(m[j], ls[j]);
        const float base = top == -INFINITY ? 0.f : top;  // no key yet: no NaN
        const float a = fast_exp2(m[j] - base), w = fast_exp2(ls[j] - base);
        m[j] = top;
        l[j] = l[j] * a + w;
        acc[j].x = acc[j].x * a + w * x[j].x;
        acc[j].y = acc[j].y * a + w * x[j].y;
        acc[j].z = acc[j].z * a + w * x[j].z;
        acc[j].w = acc[j].w * a + w * x[j].w;
      }
    }
    for (int j = 0; j < RB; ++j) {
      const int row = r0 + j * ROW_STEP;
      if (row >= rows) break;
      const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
      T* dst = out + row_offset<GROUP, D>(tok0, H, kvh, row);
      *reinterpret_cast<uint2*>(dst + 4 * c4) =
          make_uint2(Mma<T>::pack(acc[j].x * inv, acc[j].y * inv),
                     Mma<T>::pack(acc[j].z * inv, acc[j].w * inv));
    }
  }
}

// The work item's end, after its last key tile, by every thread of the block: the state of
// this thread's rows row_lo + 16 mt + 8 i (o, m_run in score units, l_run this thread's share
// of the row sum; softmax.cuh's layout), `rows` valid rows of the tile, `stages` the block's
// K/V stages (STAGE_BYTES of shared memory), `item` its row of the work list.
template <int GROUP, int BLOCK_M, int NUM_THREADS, int STAGE_BYTES, int MT, int DTILES, typename T>
__device__ __forceinline__ void finish_item(const float (&o)[MT][DTILES][4],
                                            const float (&m_run)[MT][2],
                                            const float (&l_run)[MT][2], bool warp_active,
                                            int row_lo, int rows, int tid, int lane,
                                            float scale_log2, const int* item, int slot,
                                            const int* counters, void* stages, int tok0, int H,
                                            int kvh, T* out, float* o_part, float* lse_part) {
  constexpr int D = 8 * DTILES;
  constexpr int STAGE_LD = D + 4;  // floats a staged partial row takes
  static_assert(BLOCK_M * (STAGE_LD + 1) * 4 <= STAGE_BYTES, "a partial fits the K/V stages");
  __shared__ int is_last;
  const int tile = item[W_TILE], first = item[W_FIRST_SLOT], nsplit = item[W_NUM_SPLITS];
  int* counter = const_cast<int*>(counters) + 2 * tile;
  float* staged = reinterpret_cast<float*>(stages);  // [BLOCK_M][STAGE_LD], then lse [BLOCK_M]
  if (slot >= 0) {
    __syncthreads();  // every warp is done with the K/V stages
    if (tid == 0) is_last = atomicAdd(counter, 1) == nsplit - 1;  // this split's ticket
    __syncthreads();
  }
  const bool keep = slot >= 0 && is_last;
  if (warp_active) {
    for (int mt = 0; mt < MT; ++mt)
      for (int i = 0; i < 2; ++i) {
        const float l = row_sum(l_run[mt][i]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = row_lo + 16 * mt + 8 * i;
        if (row >= rows) continue;
        if (slot < 0) {
          store_row(out + row_offset<GROUP, D>(tok0, H, kvh, row), o[mt], i, inv, lane);
        } else {
          const int col = (lane % 4) * 2;
          float* dst = keep ? staged + row * STAGE_LD
                            : o_part + (static_cast<size_t>(slot) * BLOCK_M + row) * D;
          for (int dt = 0; dt < DTILES; ++dt)
            *reinterpret_cast<float2*>(dst + dt * 8 + col) =
                make_float2(o[mt][dt][2 * i] * inv, o[mt][dt][2 * i + 1] * inv);
          if (lane % 4 == 0)
            (keep ? staged + BLOCK_M * STAGE_LD : lse_part + static_cast<size_t>(slot) * BLOCK_M)
                [row] = l > 0.f ? m_run[mt][i] * scale_log2 + log2f(l) : -INFINITY;
        }
      }
  }
  if (slot < 0) return;

  // Every thread fences its partial stores before the block's store is counted (release) ...
  __threadfence();
  __syncthreads();
  if (!is_last) {
    if (tid == 0) atomicAdd(counter + 1, 1);
    return;
  }
  // ... and the last waits for the others' (they took their tickets first, so they are running
  // and store without waiting on anything), then fences before reading them (acquire).
  if (tid == 0)
    while (load_acquire(counter + 1) < nsplit - 1) {}
  __syncthreads();
  __threadfence();
  merge_partials<GROUP, D, BLOCK_M, NUM_THREADS, STAGE_LD>(out, o_part, lse_part, staged, first,
                                                           slot - first, nsplit, rows, tid, tok0,
                                                           H, kvh);
  if (tid == 0) counter[0] = counter[1] = 0;  // ready for the plan's next launch
}
