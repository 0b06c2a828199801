// Online softmax over key tiles, in base 2, for the mma.sync and wgmma kernels alike. A warp's
// scores s[MT][NTILES][4] are in the m16n8 accumulator layout (which wgmma's accumulators
// share): this thread holds rows row_lo + 16 mt + 8 i (m16 tile mt, half i) at keys
// n0 + 8 nt + 2 (lane % 4) + {0, 1}, elements 2 i and 2 i + 1 of s[mt][nt]. A row's running
// max m_run (in score units: q.k, scale * log2(e) times them are log2 units) and sum l_run are
// this thread's share: its quad holds the row.
// The variant's features are compiled in or out (the prelude defines WINDOW, SOFTCAP and SINKS
// 0 or 1): a window of W keys masks keys at or below a row's position - W; a cap bends the
// scores before the mask; a row's sink joins its sum where the row is normalised.
// Needs Mma<T>::pack (mma_sync.cuh or wgmma.cuh) for P as an A operand.
#include "common.cuh"

// What a work item's rows see and how its scores become logits (row_state.inc builds it once
// per item).
struct Logits {
  int mask_from;  // keys below it are causally visible to every row of the tile
  int kv_end;     // keys from it on are masked
#if WINDOW
  int window;       // W: a row at position p sees keys p - W + 1 .. p
  int window_from;  // keys from it on are inside every row's window
#endif
#if SOFTCAP
  float cap_in, cap_out;  // 2 log2(e) scale / cap and cap / scale (score units)
#endif
};

#if SOFTCAP
// The cap in score units, cap / scale tanh(scale s / cap), as cap_out (1 - 2 / (e^2x + 1)):
// its error stays absolute (~1e-7 of the cap) where tanh saturates and where it crosses 0.
template <int MT, int NTILES>
__device__ __forceinline__ void cap_scores(float (&s)[MT][NTILES][4], const Logits& logits) {
  for (int mt = 0; mt < MT; ++mt)
    for (int nt = 0; nt < NTILES; ++nt)
      for (int e = 0; e < 4; ++e)
        s[mt][nt][e] = fmaf(-2.f * logits.cap_out,
                            fast_rcp(fast_exp2(s[mt][nt][e] * logits.cap_in) + 1.f),
                            logits.cap_out);
}
#endif

#if SINKS
// A row's sum l (relative to its max m_log2, log2 units) with its sink logit (natural units, as
// the model holds it) joined: once per row, where the row is normalised.
__device__ __forceinline__ float with_sink(float l, float m_log2, float sink) {
  return l + fast_exp2(fmaf(sink, 1.44269504f, -m_log2));  // log2(e)
}
#endif

// The running state of this thread's rows before the first tile; pos_row: a row's absolute
// position, the last key it sees.
template <int GROUP, int MT>
__device__ __forceinline__ void init_rows(float (&m_run)[MT][2], float (&l_run)[MT][2],
                                          int (&pos_row)[MT][2], int pos0, int row_lo) {
  for (int mt = 0; mt < MT; ++mt)
    for (int i = 0; i < 2; ++i) {
      m_run[mt][i] = -INFINITY;
      l_run[mt][i] = 0.f;
      pos_row[mt][i] = pos0 + (row_lo + 16 * mt + 8 * i) / GROUP;
    }
}

// One tile of keys n0 .. n0 + 8 NTILES: scores capped (SOFTCAP), masked by position where the
// tile reaches mask_from (keys below it are visible to every row) or kv_end, or (WINDOW) holds
// keys below window_from, then turned into probabilities; m_run and l_run updated, alpha the
// running output's rescale (rescale_o).
template <int MT, int NTILES>
__device__ __forceinline__ void online_softmax(float (&s)[MT][NTILES][4], float (&m_run)[MT][2],
                                               float (&l_run)[MT][2], float (&alpha)[MT][2],
                                               const int (&pos_row)[MT][2], int n0,
                                               const Logits& logits, int lane, float scale_log2) {
  const int mask_from = logits.mask_from, kv_end = logits.kv_end;
#if SOFTCAP
  cap_scores(s, logits);
#endif
  if (n0 + 8 * NTILES > mask_from) {  // diagonal or last tile: mask by position
    for (int mt = 0; mt < MT; ++mt)
      for (int nt = 0; nt < NTILES; ++nt)
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + nt * 8 + (lane % 4) * 2 + (e & 1);
          if (key > pos_row[mt][e / 2] || key >= kv_end) s[mt][nt][e] = -INFINITY;
        }
  }
#if WINDOW
  // Keys left of some row's window. A loop of its own, unrolled: folded into the causal mask's,
  // the 32-row-warp mma.sync variants kept the scores in local memory (432 stack bytes more).
  if (n0 < logits.window_from) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + nt * 8 + (lane % 4) * 2 + (e & 1);
          if (key <= pos_row[mt][e / 2] - logits.window) s[mt][nt][e] = -INFINITY;
        }
  }
#endif
  for (int mt = 0; mt < MT; ++mt)
    for (int i = 0; i < 2; ++i) {  // online softmax of rows row_lo + 16 mt + 8 i
      float mx = m_run[mt][i];
      for (int nt = 0; nt < NTILES; ++nt)
        mx = fmaxf(mx, fmaxf(s[mt][nt][2 * i], s[mt][nt][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      const float base = mx == -INFINITY ? 0.f : mx * scale_log2;  // no key yet: no NaN
      alpha[mt][i] = fast_exp2(m_run[mt][i] * scale_log2 - base);
      m_run[mt][i] = mx;
      float sum = 0.f;
      for (int nt = 0; nt < NTILES; ++nt)
        for (int e = 2 * i; e < 2 * i + 2; ++e) {
          s[mt][nt][e] = fast_exp2(fmaf(s[mt][nt][e], scale_log2, -base));
          sum += s[mt][nt][e];
        }
      l_run[mt][i] = l_run[mt][i] * alpha[mt][i] + sum;  // the quad sums at the end
    }
}

// The running output o[MT][DTILES][4] (the accumulator layout) rescaled for the new maxima.
template <int MT, int DTILES>
__device__ __forceinline__ void rescale_o(float (&o)[MT][DTILES][4], const float (&alpha)[MT][2]) {
  for (int mt = 0; mt < MT; ++mt)
    for (int dt = 0; dt < DTILES; ++dt)
      for (int e = 0; e < 4; ++e) o[mt][dt][e] *= alpha[mt][e / 2];
}

// P of one m16 tile as the A operand of k-step kk (keys 16 kk .. 16 kk + 15).
template <typename T, int NTILES>
__device__ __forceinline__ void p_fragment(uint32_t (&a)[4], const float (&s)[NTILES][4], int kk) {
  a[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
  a[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
  a[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}
// ... and of every k-step of the tile.
template <typename T, int NTILES>
__device__ __forceinline__ void pack_p(uint32_t (&p)[NTILES / 2][4], const float (&s)[NTILES][4]) {
#pragma unroll
  for (int kk = 0; kk < NTILES / 2; ++kk) p_fragment<T>(p[kk], s, kk);
}

// After the last tile: the row sum of a row (its quad's shares added up) ...
__device__ __forceinline__ float row_sum(float l_share) {
  l_share += __shfl_xor_sync(0xffffffff, l_share, 1);
  l_share += __shfl_xor_sync(0xffffffff, l_share, 2);
  return l_share;
}
// ... and half i of an m16 tile's output o_mt, times inv, stored as T at dst (the row in out).
template <typename T, int DTILES>
__device__ __forceinline__ void store_row(T* dst, const float (&o_mt)[DTILES][4], int i,
                                          float inv, int lane) {
  const int col = (lane % 4) * 2;
  for (int dt = 0; dt < DTILES; ++dt)
    *reinterpret_cast<uint32_t*>(dst + dt * 8 + col) =
        Mma<T>::pack(o_mt[dt][2 * i] * inv, o_mt[dt][2 * i + 1] * inv);
}
