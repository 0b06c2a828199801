// The interface between emulated kernel code and the CPU runtime (runtime.cpp) that runs every
// GPU thread of a threadgroup as an OS thread. No address-space macros here: runtime.cpp
// includes the C++ standard library after this header.
#pragma once

namespace msl::rt {

constexpr unsigned kSimdWidth = 32;
constexpr unsigned kSlotBytes = 32;            // largest value one lane passes to a SIMD collective
constexpr unsigned long kThreadgroupMemory = 32768;  // Apple GPUs' threadgroup memory limit
constexpr int kMaxThreadgroupVariables = 64;

// Blocks until every live thread of the threadgroup arrives.
void threadgroup_barrier();
// Blocks until every lane of the caller's simdgroup arrives.
void simdgroup_barrier();
// A SIMD collective: publishes `bytes` of `value` for the caller's lane, waits for every lane
// of the simdgroup, and returns the simdgroup's slots (lane i at i * kSlotBytes), which stay
// valid until the caller's next collective.
const unsigned char* simd_exchange(const void* value, unsigned bytes);
unsigned simd_lane();
unsigned simd_size();  // lanes in the caller's simdgroup (fewer than 32 in a partial one)
// The storage of threadgroup variable `site` (numbered per kernel by the source rewrite): one
// block per threadgroup, shared by its threads, poisoned (all bits set) when the group starts.
void* threadgroup_alloc(int site, unsigned long bytes, unsigned long align);
// Ends the launch with an error message (the launch runs in a child process).
[[noreturn]] void fail(const char* message);

// Built-in thread attributes of one GPU thread (plain arrays: this header has no vector types).
struct ThreadAttrs {
  unsigned thread_position_in_grid[3];
  unsigned thread_position_in_threadgroup[3];
  unsigned threadgroup_position_in_grid[3];
  unsigned threads_per_threadgroup[3];
  unsigned dispatch_threads_per_threadgroup[3];
  unsigned threadgroups_per_grid[3];
  unsigned threads_per_grid[3];
  unsigned grid_origin[3];
  unsigned grid_size[3];
  unsigned thread_index_in_threadgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned simdgroups_per_threadgroup;
  unsigned dispatch_simdgroups_per_threadgroup;
  unsigned threads_per_simdgroup;
  unsigned thread_execution_width;
  unsigned quadgroup_index_in_threadgroup;
  unsigned thread_index_in_quadgroup;
  unsigned quadgroups_per_threadgroup;
  unsigned dispatch_quadgroups_per_threadgroup;
};

}  // namespace msl::rt

// Generated per kernel (emulate.py): calls the kernel for one thread with the launch's buffers.
extern "C" void msl_emu_thread(void* const* buffers, const msl::rt::ThreadAttrs* attrs);

// The launch entry (runtime.cpp). dims: grid x, y, z then threadgroup x, y, z, in threads as
// MLX's dispatchThreads takes them. Threadgroups run `concurrency` at a time in a seeded random
// order; `jitter` > 0 adds seeded random yields after synchronisation points so that races
// between threads show up. Returns 0; errors end the process through fail().
extern "C" int msl_emu_launch(void* const* buffers, const unsigned* dims, unsigned long long seed,
                              int concurrency, int jitter, char* error, int error_len);
