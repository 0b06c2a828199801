// MSL scalar and vector types on the CPU: half and bfloat with the GPU's round-to-nearest-even
// conversions, vec<T, N> with Metal's sizes and alignments, numeric_limits, as_type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

// Metal's built-in integer spellings (glibc declares uint/ushort/ulong identically).
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

namespace msl {

template <class To, class From>
constexpr To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return __builtin_bit_cast(To, x);
}

// IEEE binary16. float -> half rounds to nearest even (F. Giesen's float_to_half_fast3_rtne);
// NaN stays a quiet NaN, overflow goes to infinity, subnormals are kept (as the GPU does).
struct HalfFormat {
  static constexpr uint16_t from_float(float f) {
    uint32_t u = bits_as<uint32_t>(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint16_t o;
    if (u >= (127u + 16u) << 23) {  // |f| >= 65536: inf, or NaN
      o = u > 0x7F800000u ? 0x7E00 : 0x7C00;
    } else if (u < 113u << 23) {  // subnormal half or zero: let the FPU round at 2^-24
      constexpr float magic = 0.5f;  // (127 - 15 + 23 - 10 + 1) << 23
      o = uint16_t(bits_as<uint32_t>(bits_as<float>(u) + magic) - bits_as<uint32_t>(magic));
    } else {
      const uint32_t mant_odd = (u >> 13) & 1u;
      u += (uint32_t(15 - 127) << 23) + 0xFFFu + mant_odd;
      o = uint16_t(u >> 13);
    }
    return uint16_t(o | (sign >> 16));
  }
  static constexpr float to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0x1F) return bits_as<float>(sign | 0x7F800000u | (mant << 13));
    if (exp == 0) return bits_as<float>(sign | bits_as<uint32_t>(float(mant) * 0x1p-24f));
    return bits_as<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  }
  static constexpr uint16_t inf_bits = 0x7C00, max_bits = 0x7BFF, min_bits = 0x0400,
                            epsilon_bits = 0x1400;
};

// bfloat16: the top half of a float, rounded to nearest even; NaN stays a quiet NaN.
struct BFloatFormat {
  static constexpr uint16_t from_float(float f) {
    const uint32_t u = bits_as<uint32_t>(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  static constexpr float to_float(uint16_t b) { return bits_as<float>(uint32_t(b) << 16); }
  static constexpr uint16_t inf_bits = 0x7F80, max_bits = 0x7F7F, min_bits = 0x0080,
                            epsilon_bits = 0x3C00;
};

// A 16-bit float that computes in float and rounds every result back, like C's arithmetic on a
// narrower floating type. Implicit conversions both ways, as Metal's built-in half/bfloat.
template <class Format>
struct SmallFloat {
  uint16_t bits;
  SmallFloat() = default;
  constexpr SmallFloat(float f) : bits(Format::from_float(f)) {}
  constexpr operator float() const { return Format::to_float(bits); }
  static constexpr SmallFloat from_bits(uint16_t b) {
    SmallFloat s;
    s.bits = b;
    return s;
  }
  constexpr SmallFloat operator-() const { return from_bits(uint16_t(bits ^ 0x8000u)); }
  constexpr SmallFloat operator+() const { return *this; }
  template <class U> constexpr SmallFloat& operator+=(U v) { return *this = SmallFloat(float(*this) + float(v)); }
  template <class U> constexpr SmallFloat& operator-=(U v) { return *this = SmallFloat(float(*this) - float(v)); }
  template <class U> constexpr SmallFloat& operator*=(U v) { return *this = SmallFloat(float(*this) * float(v)); }
  template <class U> constexpr SmallFloat& operator/=(U v) { return *this = SmallFloat(float(*this) / float(v)); }
};

template <class T> struct is_small_float : std::false_type {};
template <class F> struct is_small_float<SmallFloat<F>> : std::true_type {};
template <class T> inline constexpr bool is_small_float_v = is_small_float<std::remove_cv_t<T>>::value;

// The result of a binary operation with at least one 16-bit float operand, following C's usual
// arithmetic conversions with float ranking above half/bfloat (Metal has no double: a double
// operand, i.e. an unsuffixed literal, counts as float). Mixing half with bfloat has no overload.
template <class A, class B, class = void> struct mixed {};
template <class F> struct mixed<SmallFloat<F>, SmallFloat<F>> { using type = SmallFloat<F>; };
template <class F, class U>
struct mixed<SmallFloat<F>, U, std::enable_if_t<std::is_arithmetic_v<U>>> {
  using type = std::conditional_t<std::is_floating_point_v<U>, float, SmallFloat<F>>;
};
template <class F, class U>
struct mixed<U, SmallFloat<F>, std::enable_if_t<std::is_arithmetic_v<U>>> : mixed<SmallFloat<F>, U> {};
template <class A, class B> using mixed_t = typename mixed<std::remove_cv_t<A>, std::remove_cv_t<B>>::type;

#define MSL_SMALL_FLOAT_OP(OP)                                                         \
  template <class A, class B>                                                          \
  constexpr mixed_t<A, B> operator OP(A a, B b) {                                      \
    return mixed_t<A, B>(float(a) OP float(b));                                        \
  }
MSL_SMALL_FLOAT_OP(+)
MSL_SMALL_FLOAT_OP(-)
MSL_SMALL_FLOAT_OP(*)
MSL_SMALL_FLOAT_OP(/)
#undef MSL_SMALL_FLOAT_OP
#define MSL_SMALL_FLOAT_CMP(OP)                                                        \
  template <class A, class B, class = mixed_t<A, B>>                                   \
  constexpr bool operator OP(A a, B b) {                                               \
    return float(a) OP float(b);                                                       \
  }
MSL_SMALL_FLOAT_CMP(==)
MSL_SMALL_FLOAT_CMP(!=)
MSL_SMALL_FLOAT_CMP(<)
MSL_SMALL_FLOAT_CMP(>)
MSL_SMALL_FLOAT_CMP(<=)
MSL_SMALL_FLOAT_CMP(>=)
#undef MSL_SMALL_FLOAT_CMP

}  // namespace msl

typedef msl::SmallFloat<msl::HalfFormat> half;
typedef msl::SmallFloat<msl::BFloatFormat> bfloat;

namespace metal {

template <class T>
struct numeric_limits : std::numeric_limits<T> {};

template <class F>
struct numeric_limits<msl::SmallFloat<F>> {
  using T = msl::SmallFloat<F>;
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false;
  static constexpr bool has_infinity = true, has_quiet_NaN = true;
  static constexpr T infinity() { return T::from_bits(F::inf_bits); }
  static constexpr T quiet_NaN() { return T(__builtin_nanf("")); }
  static constexpr T max() { return T::from_bits(F::max_bits); }
  static constexpr T lowest() { return -max(); }
  static constexpr T min() { return T::from_bits(F::min_bits); }
  static constexpr T epsilon() { return T::from_bits(F::epsilon_bits); }
};

// vec<T, N>: Metal's vector types. Sizes and alignments follow Metal (a 3-vector occupies four
// elements), so device pointers may be cast to vector pointers as kernels do.
template <class T, int N> struct vec;

#define MSL_VEC_COMMON(N)                                                              \
  using value_type = T;                                                                \
  static constexpr int size = N;                                                       \
  vec() = default;                                                                     \
  constexpr vec(T s) { for (int i = 0; i < N; ++i) (*this)[i] = s; }                   \
  template <class U>                                                                   \
  explicit constexpr vec(const vec<U, N>& o) { for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]); } \
  constexpr T& operator[](int i) { return (&x)[i]; }                                   \
  constexpr const T& operator[](int i) const { return (&x)[i]; }

template <class T> struct alignas(2 * sizeof(T)) vec<T, 2> {
  T x, y;
  MSL_VEC_COMMON(2)
  constexpr vec(T a, T b) : x(a), y(b) {}
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 3> {
  T x, y, z;
  MSL_VEC_COMMON(3)
  constexpr vec(T a, T b, T c) : x(a), y(b), z(c) {}
};
template <class T> struct alignas(4 * sizeof(T)) vec<T, 4> {
  T x, y, z, w;
  MSL_VEC_COMMON(4)
  constexpr vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  constexpr vec(vec<T, 2> a, vec<T, 2> b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
};
#undef MSL_VEC_COMMON

template <class T> struct is_vec : std::false_type {};
template <class T, int N> struct is_vec<vec<T, N>> : std::true_type {};

#define MSL_VEC_OP(OP)                                                                 \
  template <class T, int N>                                                            \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {            \
    vec<T, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]);                                \
    return r;                                                                          \
  }                                                                                    \
  template <class T, int N, class S, class = std::enable_if_t<!is_vec<S>::value>>      \
  constexpr vec<T, N> operator OP(const vec<T, N>& a, S s) { return a OP vec<T, N>(T(s)); } \
  template <class T, int N, class S, class = std::enable_if_t<!is_vec<S>::value>>      \
  constexpr vec<T, N> operator OP(S s, const vec<T, N>& a) { return vec<T, N>(T(s)) OP a; } \
  template <class T, int N, class S>                                                   \
  constexpr vec<T, N>& operator OP##=(vec<T, N>& a, const S& s) { return a = a OP s; }
MSL_VEC_OP(+)
MSL_VEC_OP(-)
MSL_VEC_OP(*)
MSL_VEC_OP(/)
#undef MSL_VEC_OP

template <class T, int N>
constexpr vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = -a[i];
  return r;
}

template <class To, class From>
constexpr To as_type(From x) { return msl::bits_as<To>(x); }

}  // namespace metal

#define MSL_VEC_TYPEDEFS(T, NAME)                                                      \
  typedef metal::vec<T, 2> NAME##2;                                                    \
  typedef metal::vec<T, 3> NAME##3;                                                    \
  typedef metal::vec<T, 4> NAME##4;
MSL_VEC_TYPEDEFS(float, float)
MSL_VEC_TYPEDEFS(half, half)
MSL_VEC_TYPEDEFS(bfloat, bfloat)
MSL_VEC_TYPEDEFS(int, int)
MSL_VEC_TYPEDEFS(uint, uint)
MSL_VEC_TYPEDEFS(short, short)
MSL_VEC_TYPEDEFS(ushort, ushort)
MSL_VEC_TYPEDEFS(char, char)
MSL_VEC_TYPEDEFS(uchar, uchar)
MSL_VEC_TYPEDEFS(long, long)
MSL_VEC_TYPEDEFS(ulong, ulong)
MSL_VEC_TYPEDEFS(bool, bool)
#undef MSL_VEC_TYPEDEFS
