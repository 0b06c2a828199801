// MSL synchronisation and SIMD-group features over the CPU runtime: barriers, SIMD shuffles and
// reductions, 8x8 simdgroup matrices with MLX steel's fragment layout, threadgroup variables. Every collective is a real exchange between the lanes' OS threads (runtime.h).
#pragma once

#include <type_traits>

#include "math.h"
#include "runtime.h"

namespace metal {

enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }

// Every barrier orders all memory here, whatever its flags: a barrier whose flags omit the
// memory a kernel shares is not caught.
inline void threadgroup_barrier(mem_flags) { msl::rt::threadgroup_barrier(); }
inline void simdgroup_barrier(mem_flags) { msl::rt::simdgroup_barrier(); }

}  // namespace metal

namespace msl {

// Value `lane` passed to the collective whose slots are `slots`.
template <class T>
T slot_value(const unsigned char* slots, unsigned lane) {
  T v;
  __builtin_memcpy(&v, slots + lane * rt::kSlotBytes, sizeof(T));
  return v;
}

template <class T>
const unsigned char* exchange(const T& v) {
  static_assert(sizeof(T) <= rt::kSlotBytes, "SIMD collective on a value over 32 bytes");
  static_assert(std::is_trivially_copyable_v<T>, "SIMD collective on a non-trivial type");
  return rt::simd_exchange(&v, sizeof(T));
}

// Lane `src`'s value, or the caller's own when `src` is past the simdgroup (Metal leaves
// shuffles from lanes that do not exist undefined; keeping the value is the common hardware
// result and the one steel relies on for shuffle_down reductions).
template <class T>
T shuffle_from(const T& v, unsigned src) {
  const unsigned char* slots = exchange(v);
  return src < rt::simd_size() ? slot_value<T>(slots, src) : v;
}

// Butterfly reduction over the simdgroup, as a hardware tree would associate it; every lane
// computes the same result from the exchanged values.
template <class T, class Op>
T reduce(const T& v, Op op) {
  const unsigned char* slots = exchange(v);
  const unsigned n = rt::simd_size();
  T vals[rt::kSimdWidth];
  for (unsigned i = 0; i < n; ++i) vals[i] = slot_value<T>(slots, i);
  for (unsigned m = rt::kSimdWidth / 2; m > 0; m /= 2) {
    T next[rt::kSimdWidth];
    for (unsigned i = 0; i < n; ++i) next[i] = (i ^ m) < n ? op(vals[i], vals[i ^ m]) : vals[i];
    for (unsigned i = 0; i < n; ++i) vals[i] = next[i];
  }
  return vals[rt::simd_lane()];
}

template <class T, class Op>
T prefix(const T& v, Op op, bool inclusive, T identity) {
  const unsigned char* slots = exchange(v);
  const unsigned lane = rt::simd_lane();
  T acc = identity;
  for (unsigned i = 0; i < lane + (inclusive ? 1 : 0); ++i) acc = op(acc, slot_value<T>(slots, i));
  return acc;
}

// MLX steel's 8x8 fragment layout (steel/gemm/mma.h, BaseMMAFrag::get_coord): lane holds row
// frag_row(lane), columns frag_col(lane) and frag_col(lane) + 1.
constexpr unsigned frag_row(unsigned lane) { return (lane / 4 & 4) + (lane / 2) % 4; }
constexpr unsigned frag_col(unsigned lane) { return (lane / 4 & 2) * 2 + (lane % 2) * 2; }
// The lane holding (row, col): the inverse of the layout above, tabulated.
struct FragLanes {
  unsigned char lane[8][8];
  constexpr FragLanes() : lane{} {
    for (unsigned l = 0; l < rt::kSimdWidth; ++l)
      for (unsigned e = 0; e < 2; ++e) lane[frag_row(l)][frag_col(l) + e] = static_cast<unsigned char>(l);
  }
};
inline constexpr FragLanes kFragLanes{};

template <class T>
T& threadgroup_var(int site) {
  return *static_cast<T*>(rt::threadgroup_alloc(site, sizeof(T), alignof(T)));
}

}  // namespace msl

namespace metal {

template <class T> T simd_shuffle(T v, ushort lane) { return msl::shuffle_from(v, lane); }
template <class T> T simd_broadcast(T v, ushort lane) { return msl::shuffle_from(v, lane); }
template <class T> T simd_broadcast_first(T v) { return msl::shuffle_from(v, 0); }
template <class T> T simd_shuffle_xor(T v, ushort mask) {
  return msl::shuffle_from(v, msl::rt::simd_lane() ^ mask);
}
template <class T> T simd_shuffle_down(T v, ushort delta) {
  return msl::shuffle_from(v, msl::rt::simd_lane() + delta);
}
template <class T> T simd_shuffle_up(T v, ushort delta) {
  const unsigned lane = msl::rt::simd_lane();
  return msl::shuffle_from(v, lane >= delta ? lane - delta : msl::rt::kSimdWidth);
}
template <class T> T simd_shuffle_rotate_down(T v, ushort delta) {
  return msl::shuffle_from(v, (msl::rt::simd_lane() + delta) % msl::rt::simd_size());
}
template <class T> T simd_shuffle_rotate_up(T v, ushort delta) {
  const unsigned n = msl::rt::simd_size();
  return msl::shuffle_from(v, (msl::rt::simd_lane() + n - delta % n) % n);
}

template <class T> T simd_sum(T v) { return msl::reduce(v, [](T a, T b) { return T(a + b); }); }
template <class T> T simd_product(T v) { return msl::reduce(v, [](T a, T b) { return T(a * b); }); }
template <class T> T simd_max(T v) { return msl::reduce(v, [](T a, T b) { return max(a, b); }); }
template <class T> T simd_min(T v) { return msl::reduce(v, [](T a, T b) { return min(a, b); }); }
template <class T> T simd_and(T v) { return msl::reduce(v, [](T a, T b) { return T(a & b); }); }
template <class T> T simd_or(T v) { return msl::reduce(v, [](T a, T b) { return T(a | b); }); }
template <class T> T simd_xor(T v) { return msl::reduce(v, [](T a, T b) { return T(a ^ b); }); }
inline bool simd_all(bool b) { return msl::reduce(b, [](bool x, bool y) { return x && y; }); }
inline bool simd_any(bool b) { return msl::reduce(b, [](bool x, bool y) { return x || y; }); }
template <class T> T simd_prefix_inclusive_sum(T v) {
  return msl::prefix(v, [](T a, T b) { return T(a + b); }, true, T(0));
}
template <class T> T simd_prefix_exclusive_sum(T v) {
  return msl::prefix(v, [](T a, T b) { return T(a + b); }, false, T(0));
}
template <class T> T simd_prefix_inclusive_product(T v) {
  return msl::prefix(v, [](T a, T b) { return T(a * b); }, true, T(1));
}
template <class T> T simd_prefix_exclusive_product(T v) {
  return msl::prefix(v, [](T a, T b) { return T(a * b); }, false, T(1));
}

// simdgroup_matrix<T, Cols, Rows>: 8x8, each lane holding two elements of one row (steel's layout).
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulation has 8x8 simdgroup matrices only");
  vec<T, 2> elems;
  simdgroup_matrix() = default;
  // Metal's diagonal constructor: `diagonal` on the diagonal, zero elsewhere.
  explicit simdgroup_matrix(T diagonal) {
    const unsigned lane = msl::rt::simd_lane(), row = msl::frag_row(lane);
    for (unsigned e = 0; e < 2; ++e) elems[e] = row == msl::frag_col(lane) + e ? diagonal : T(0);
  }
  vec<T, 2>& thread_elements() { return elems; }
  const vec<T, 2>& thread_elements() const { return elems; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.elems = vec<T, 2>(value);
  return m;
}

// origin.x is the column, origin.y the row of the matrix's first element in memory; a
// transposed load reads element (r, c) from memory row c, column r.
template <class T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                    ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  const unsigned lane = msl::rt::simd_lane(), row = msl::frag_row(lane), col = msl::frag_col(lane);
  const T* base = src + matrix_origin.y * elements_per_row + matrix_origin.x;
  for (unsigned e = 0; e < 2; ++e)
    d.elems[e] = transpose_matrix ? base[(col + e) * elements_per_row + row]
                                  : base[row * elements_per_row + col + e];
}

template <class T, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, T* dst, ulong elements_per_row = Cols,
                     ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  const unsigned lane = msl::rt::simd_lane(), row = msl::frag_row(lane), col = msl::frag_col(lane);
  T* base = dst + matrix_origin.y * elements_per_row + matrix_origin.x;
  for (unsigned e = 0; e < 2; ++e)
    (transpose_matrix ? base[(col + e) * elements_per_row + row]
                      : base[row * elements_per_row + col + e]) = a.elems[e];
}

// D = A B + C over the simdgroup: the lanes exchange their A and B elements (one collective),
// then each lane computes its own two elements of D in float, k in order with fused adds.
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b,
                                   const simdgroup_matrix<TC, 8, 8>& c) {
  if (msl::rt::simd_size() != msl::rt::kSimdWidth)
    msl::rt::fail("simdgroup matrix operation in a partial simdgroup");
  struct Operands { float a[2], b[2]; };
  const Operands mine = {{float(a.elems[0]), float(a.elems[1])}, {float(b.elems[0]), float(b.elems[1])}};
  const unsigned char* slots = msl::exchange(mine);
  const unsigned lane = msl::rt::simd_lane(), row = msl::frag_row(lane), col = msl::frag_col(lane);
  float out[2];
  for (unsigned e = 0; e < 2; ++e) {
    float acc = float(c.elems[e]);
    for (unsigned k = 0; k < 8; ++k) {
      const float a_rk = msl::slot_value<Operands>(slots, msl::kFragLanes.lane[row][k]).a[k & 1];
      const float b_kc = msl::slot_value<Operands>(slots, msl::kFragLanes.lane[k][col + e]).b[(col + e) & 1];
      acc = __builtin_fmaf(a_rk, b_kc, acc);
    }
    out[e] = acc;
  }
  d.elems = vec<TD, 2>(TD(out[0]), TD(out[1]));
}

template <class TD, class TA, class TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                        const simdgroup_matrix<TB, 8, 8>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)));
}

}  // namespace metal
