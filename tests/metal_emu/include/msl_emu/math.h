// metal:: math with MLX's default "safe" math mode: IEEE special values (exp2(-inf) == 0,
// inf and NaN propagate), computed in float through the compiler builtins (no <cmath>, so no
// C library names leak into the global namespace where they could shadow a kernel's). 16-bit
// floats compute in float and round the result; vectors apply the scalar function per element.
#pragma once

#include <type_traits>

#include "types.h"

// <metal_math>'s constants (float versions) that kernels here use.
#define M_LOG2E_F 1.4426950408889634074f

namespace metal {

#define MSL_MATH_1(NAME, EXPR)                                                         \
  inline float NAME(float x) { return EXPR; }                                          \
  template <class F>                                                                   \
  inline msl::SmallFloat<F> NAME(msl::SmallFloat<F> h) {                               \
    return msl::SmallFloat<F>(NAME(float(h)));                                         \
  }                                                                                    \
  template <class T, int N>                                                            \
  inline vec<T, N> NAME(vec<T, N> v) {                                                 \
    for (int i = 0; i < N; ++i) v[i] = NAME(v[i]);                                     \
    return v;                                                                          \
  }
MSL_MATH_1(exp, __builtin_expf(x))
MSL_MATH_1(exp2, __builtin_exp2f(x))
MSL_MATH_1(log, __builtin_logf(x))
MSL_MATH_1(log2, __builtin_log2f(x))
MSL_MATH_1(log10, __builtin_log10f(x))
MSL_MATH_1(sqrt, __builtin_sqrtf(x))
MSL_MATH_1(rsqrt, 1.0f / __builtin_sqrtf(x))
MSL_MATH_1(sin, __builtin_sinf(x))
MSL_MATH_1(cos, __builtin_cosf(x))
MSL_MATH_1(tanh, __builtin_tanhf(x))
MSL_MATH_1(floor, __builtin_floorf(x))
MSL_MATH_1(ceil, __builtin_ceilf(x))
MSL_MATH_1(round, __builtin_roundf(x))
MSL_MATH_1(rint, __builtin_rintf(x))
MSL_MATH_1(trunc, __builtin_truncf(x))
MSL_MATH_1(fabs, __builtin_fabsf(x))
#undef MSL_MATH_1

// Integer max/min/abs first: the vector overloads below look them up.
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
constexpr T max(T a, T b) { return a < b ? b : a; }
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
constexpr T min(T a, T b) { return b < a ? b : a; }
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
constexpr T abs(T a) { return a < 0 ? T(-a) : a; }

// Float max/min are fmax/fmin (a NaN operand yields the other operand), as Metal's are.
#define MSL_MATH_2(NAME, EXPR)                                                         \
  inline float NAME(float x, float y) { return EXPR; }                                 \
  template <class F>                                                                   \
  inline msl::SmallFloat<F> NAME(msl::SmallFloat<F> a, msl::SmallFloat<F> b) {         \
    return msl::SmallFloat<F>(NAME(float(a), float(b)));                               \
  }                                                                                    \
  template <class T, int N>                                                            \
  inline vec<T, N> NAME(vec<T, N> a, vec<T, N> b) {                                    \
    for (int i = 0; i < N; ++i) a[i] = NAME(a[i], b[i]);                               \
    return a;                                                                          \
  }
MSL_MATH_2(pow, __builtin_powf(x, y))
MSL_MATH_2(fmax, __builtin_fmaxf(x, y))
MSL_MATH_2(fmin, __builtin_fminf(x, y))
MSL_MATH_2(max, __builtin_fmaxf(x, y))
MSL_MATH_2(min, __builtin_fminf(x, y))
MSL_MATH_2(atan2, __builtin_atan2f(x, y))
MSL_MATH_2(fmod, __builtin_fmodf(x, y))
MSL_MATH_2(copysign, __builtin_copysignf(x, y))
#undef MSL_MATH_2
// Mixed argument types (uint with int, half with float) match no single overload on Metal
// either: reject them instead of converting silently.
template <class A, class B> void max(A, B) = delete;
template <class A, class B> void min(A, B) = delete;

inline float abs(float x) { return __builtin_fabsf(x); }
template <class F>
inline msl::SmallFloat<F> abs(msl::SmallFloat<F> h) { return msl::SmallFloat<F>::from_bits(h.bits & 0x7FFF); }

template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
template <class F>
inline msl::SmallFloat<F> fma(msl::SmallFloat<F> a, msl::SmallFloat<F> b, msl::SmallFloat<F> c) {
  return msl::SmallFloat<F>(__builtin_fmaf(float(a), float(b), float(c)));
}

template <class T>
inline T mix(T x, T y, T a) { return x + (y - x) * a; }
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }

inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool signbit(float x) { return __builtin_signbit(x); }
template <class F> inline bool isnan(msl::SmallFloat<F> h) { return isnan(float(h)); }
template <class F> inline bool isinf(msl::SmallFloat<F> h) { return isinf(float(h)); }
template <class F> inline bool isfinite(msl::SmallFloat<F> h) { return isfinite(float(h)); }

// Metal's precise:: and fast:: variants. Fast math's looser accuracy is not emulated: both
// compute like the default (safe) functions.
#define MSL_MATH_NAMESPACE(NS)                                                         \
  namespace NS {                                                                       \
  using metal::exp; using metal::exp2; using metal::log; using metal::log2;            \
  using metal::log10; using metal::sqrt; using metal::rsqrt; using metal::sin;         \
  using metal::cos; using metal::tanh; using metal::pow; using metal::fmax;            \
  using metal::fmin; using metal::max; using metal::min; using metal::fabs;            \
  using metal::abs; using metal::floor; using metal::ceil; using metal::round;         \
  using metal::trunc; using metal::fma; using metal::clamp;                            \
  }
MSL_MATH_NAMESPACE(precise)
MSL_MATH_NAMESPACE(fast)
#undef MSL_MATH_NAMESPACE

}  // namespace metal
