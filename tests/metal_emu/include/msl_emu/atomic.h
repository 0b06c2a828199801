// MSL atomics: Metal's atomic<T> is a plain T operated on by the compiler's __atomic builtins
// (not std::atomic, whose header alone would triple every kernel's compile time), so that
// `device atomic<float>*` outputs and threadgroup atomics address plain memory as on the GPU.
#pragma once

#include <type_traits>

#include "sync.h"

namespace metal {

enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst,
};
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

template <class T>
struct atomic {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "atomic<T> of a small plain T");
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<bool> atomic_bool;
typedef atomic<float> atomic_float;
typedef atomic<ulong> atomic_ulong;

}  // namespace metal

namespace msl {

constexpr int gcc_order(metal::memory_order mo) {
  switch (mo) {
    case metal::memory_order_acquire: return __ATOMIC_ACQUIRE;
    case metal::memory_order_release: return __ATOMIC_RELEASE;
    case metal::memory_order_acq_rel: return __ATOMIC_ACQ_REL;
    case metal::memory_order_seq_cst: return __ATOMIC_SEQ_CST;
    default: return __ATOMIC_RELAXED;
  }
}
// A load or store cannot release or acquire respectively: the nearest order that can.
constexpr int load_order(metal::memory_order mo) {
  return mo == metal::memory_order_relaxed ? __ATOMIC_RELAXED : __ATOMIC_ACQUIRE;
}
constexpr int store_order(metal::memory_order mo) {
  return mo == metal::memory_order_relaxed ? __ATOMIC_RELAXED : __ATOMIC_RELEASE;
}

template <class T>
T* value_of(volatile metal::atomic<T>* object) {
  return &const_cast<metal::atomic<T>*>(object)->value;
}

template <class T, class Op>
T fetch_update(volatile metal::atomic<T>* object, T operand, metal::memory_order mo, Op op) {
  T* p = value_of(object);
  T old;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  T desired = op(old, operand);
  while (!__atomic_compare_exchange(p, &old, &desired, true, gcc_order(mo), __ATOMIC_RELAXED))
    desired = op(old, operand);
  return old;
}

}  // namespace msl

namespace metal {

template <class T> using atomic_value_t = std::type_identity_t<T>;

template <class T>
void atomic_store_explicit(volatile atomic<T>* o, atomic_value_t<T> v, memory_order mo) {
  __atomic_store(msl::value_of(o), &v, msl::store_order(mo));
}
template <class T>
T atomic_load_explicit(volatile atomic<T>* o, memory_order mo) {
  T v;
  __atomic_load(msl::value_of(o), &v, msl::load_order(mo));
  return v;
}
template <class T>
T atomic_exchange_explicit(volatile atomic<T>* o, atomic_value_t<T> v, memory_order mo) {
  T old;
  __atomic_exchange(msl::value_of(o), &v, &old, msl::gcc_order(mo));
  return old;
}
template <class T>
bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, T* expected, atomic_value_t<T> desired,
                                           memory_order success, memory_order failure) {
  return __atomic_compare_exchange(msl::value_of(o), expected, &desired, true, msl::gcc_order(success),
                                   msl::load_order(failure));
}
#define MSL_ATOMIC_FETCH(NAME, EXPR)                                                   \
  template <class T>                                                                   \
  T atomic_fetch_##NAME##_explicit(volatile atomic<T>* o, atomic_value_t<T> v, memory_order mo) { \
    return msl::fetch_update(o, v, mo, [](T a, T b) { return T(EXPR); });             \
  }
MSL_ATOMIC_FETCH(add, a + b)
MSL_ATOMIC_FETCH(sub, a - b)
MSL_ATOMIC_FETCH(and, a & b)
MSL_ATOMIC_FETCH(or, a | b)
MSL_ATOMIC_FETCH(xor, a ^ b)
MSL_ATOMIC_FETCH(min, b < a ? b : a)
MSL_ATOMIC_FETCH(max, a < b ? b : a)
#undef MSL_ATOMIC_FETCH

inline void atomic_thread_fence(mem_flags, memory_order mo, thread_scope = thread_scope_device) {
  __atomic_thread_fence(msl::gcc_order(mo));
}

}  // namespace metal
