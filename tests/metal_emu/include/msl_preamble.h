// Stand-in for MLX's kernel preamble (metal::utils(): mlx/backend/metal/kernels/utils.h with
// bf16.h, defines.h, ...), which MLX prepends to every custom kernel's source. Provides the
// names kernels commonly rely on; complex64_t, elem_to_loc and the rest of utils.h are absent.
#pragma once

#include "msl_emu.h"

using namespace metal;

typedef bfloat bfloat16_t;
typedef half float16_t;

inline uint16_t bfloat16_to_uint16(const bfloat16_t x) { return as_type<uint16_t>(x); }
inline bfloat16_t uint16_to_bfloat16(const uint16_t x) { return as_type<bfloat16_t>(x); }

#define MTL_CONST constant
#define MLX_MTL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")
#define instantiate_kernel(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;

template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}
