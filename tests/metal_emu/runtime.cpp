// CPU runtime for emulated Metal kernels: every GPU thread of a threadgroup is an OS thread;
// threadgroup_barrier and every SIMD collective are real barriers between those threads.
//
// A launch runs `concurrency` threadgroups at a time, each on its own pool of worker threads
// (as many as a threadgroup has threads), taking threadgroups from a seeded shuffle of the grid
// so that no kernel can depend on their order. A thread that returns from the kernel leaves its
// barriers; a barrier that completes after a thread left is divergent (undefined on the GPU)
// and fails the launch. With jitter, threads yield at random after each synchronisation point,
// so that a missing barrier lets a fast thread overtake a slow one.
#include "include/msl_emu/runtime.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace msl::rt {
namespace {

// A generation barrier that threads may leave for good (drop) when they return from the kernel.
class Barrier {
 public:
  // Only while no thread waits (between threadgroups).
  void reset(unsigned participants) {
    expected_ = participants;
    arrived_ = 0;
    dropped_ = 0;
  }

  void arrive_and_wait(const char* divergent) {
    std::unique_lock<std::mutex> lock(m_);
    const unsigned gen = gen_.load(std::memory_order_relaxed);
    if (++arrived_ == expected_) {
      complete(divergent);
      lock.unlock();
      gen_.notify_all();
      return;
    }
    lock.unlock();
    while (gen_.load(std::memory_order_acquire) == gen) gen_.wait(gen, std::memory_order_acquire);
  }

  void drop(const char* divergent) {
    std::unique_lock<std::mutex> lock(m_);
    --expected_;
    ++dropped_;
    if (arrived_ > 0 && arrived_ == expected_) {
      complete(divergent);
      lock.unlock();
      gen_.notify_all();
    }
  }

 private:
  void complete(const char* divergent) {
    if (dropped_ > 0) fail(divergent);
    arrived_ = 0;
    gen_.fetch_add(1, std::memory_order_release);
  }

  std::mutex m_;
  unsigned expected_ = 0, arrived_ = 0, dropped_ = 0;
  std::atomic<unsigned> gen_{0};
};

struct SimdGroup {
  Barrier barrier;
  unsigned lanes = 0;
  // Double-buffered: a lane writes slot set n % 2 for its n-th collective; every lane has left
  // collective n - 1 (and read its slots) before any lane can pass collective n + 1's barrier.
  alignas(64) unsigned char slots[2][kSimdWidth][kSlotBytes];
};

// One threadgroup in flight, with the worker threads that play its GPU threads.
struct Group {
  explicit Group(unsigned workers)
      : num_simdgroups((workers + kSimdWidth - 1) / kSimdWidth),
        simdgroups(new SimdGroup[num_simdgroups]) {
    pool.reset(workers);
  }
  Barrier pool;  // all workers, between threadgroups
  Barrier threadgroup;
  unsigned num_simdgroups;
  std::unique_ptr<SimdGroup[]> simdgroups;
  alignas(64) unsigned char memory[kThreadgroupMemory];
  std::mutex alloc_mutex;
  long offsets[kMaxThreadgroupVariables];
  unsigned long used = 0;
  // the threadgroup now running
  bool done = false;
  unsigned position[3] = {}, size[3] = {}, threads = 0;
};

struct Launch {
  void* const* buffers;
  unsigned grid[3], dispatch[3], groups_per_grid[3];
  std::vector<unsigned> order;  // threadgroups (linear index) in run order
  std::atomic<unsigned> next{0};
  unsigned long long seed;
  int jitter;
};

Launch* g_launch = nullptr;
char* g_error = nullptr;
int g_error_len = 0;

struct ThreadState {
  Group* group = nullptr;
  SimdGroup* simdgroup = nullptr;
  unsigned lane = 0, parity = 0;
  uint64_t rng = 0;
};
thread_local ThreadState t_state;

uint64_t splitmix(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// After a synchronisation point: now and then yield (one time in 32) or spin up to a few
// microseconds (one time in 8), so that threads leave a barrier in a random order and at
// random distances. Yields are rare because each one costs a trip through every runnable thread.
void jitter_point() {
  if (!g_launch->jitter) return;
  const uint64_t r = splitmix(t_state.rng);
  if ((r & 31) == 0) sched_yield();
  if (((r >> 5) & 7) == 0) {
    for (unsigned spin = unsigned(r >> 16) & 4095; spin > 0; --spin) asm volatile("");
  }
}

void next_threadgroup(Group& g, Launch& launch) {
  const unsigned i = launch.next.fetch_add(1);
  if (i >= launch.order.size()) {
    g.done = true;
    return;
  }
  unsigned linear = launch.order[i];
  g.threads = 1;
  for (int d = 0; d < 3; ++d) {
    g.position[d] = linear % launch.groups_per_grid[d];
    linear /= launch.groups_per_grid[d];
    // dispatchThreads: the last threadgroup of a dimension holds what is left of the grid
    g.size[d] = std::min(launch.dispatch[d], launch.grid[d] - g.position[d] * launch.dispatch[d]);
    g.threads *= g.size[d];
  }
  g.threadgroup.reset(g.threads);
  for (unsigned s = 0; s < g.num_simdgroups; ++s) {
    const unsigned first = s * kSimdWidth;
    g.simdgroups[s].lanes = first < g.threads ? std::min(kSimdWidth, g.threads - first) : 0;
    g.simdgroups[s].barrier.reset(g.simdgroups[s].lanes);
  }
  std::memset(g.memory, 0xFF, sizeof(g.memory));  // uninitialised threadgroup memory reads NaN / -1
  std::fill(std::begin(g.offsets), std::end(g.offsets), -1L);
  g.used = 0;
}

ThreadAttrs thread_attrs(const Group& g, const Launch& launch, unsigned local) {
  ThreadAttrs a{};
  const unsigned in_tg[3] = {local % g.size[0], local / g.size[0] % g.size[1], local / (g.size[0] * g.size[1])};
  for (int d = 0; d < 3; ++d) {
    a.thread_position_in_threadgroup[d] = in_tg[d];
    a.threadgroup_position_in_grid[d] = g.position[d];
    a.thread_position_in_grid[d] = g.position[d] * launch.dispatch[d] + in_tg[d];
    a.threads_per_threadgroup[d] = g.size[d];
    a.dispatch_threads_per_threadgroup[d] = launch.dispatch[d];
    a.threadgroups_per_grid[d] = launch.groups_per_grid[d];
    a.threads_per_grid[d] = launch.grid[d];
    a.grid_size[d] = launch.grid[d];
  }
  const unsigned dispatch_threads = launch.dispatch[0] * launch.dispatch[1] * launch.dispatch[2];
  a.thread_index_in_threadgroup = local;
  a.simdgroup_index_in_threadgroup = local / kSimdWidth;
  a.thread_index_in_simdgroup = local % kSimdWidth;
  a.simdgroups_per_threadgroup = (g.threads + kSimdWidth - 1) / kSimdWidth;
  a.dispatch_simdgroups_per_threadgroup = (dispatch_threads + kSimdWidth - 1) / kSimdWidth;
  a.threads_per_simdgroup = a.thread_execution_width = kSimdWidth;
  a.quadgroup_index_in_threadgroup = local / 4;
  a.thread_index_in_quadgroup = local % 4;
  a.quadgroups_per_threadgroup = (g.threads + 3) / 4;
  a.dispatch_quadgroups_per_threadgroup = (dispatch_threads + 3) / 4;
  return a;
}

void run_thread(Group& g, Launch& launch, unsigned local) {
  const ThreadAttrs attrs = thread_attrs(g, launch, local);
  t_state.group = &g;
  t_state.simdgroup = &g.simdgroups[local / kSimdWidth];
  t_state.lane = local % kSimdWidth;
  t_state.parity = 0;
  jitter_point();
  msl_emu_thread(launch.buffers, &attrs);
  t_state.simdgroup->barrier.drop("a SIMD collective ran after lanes of its simdgroup had returned");
  g.threadgroup.drop("threadgroup_barrier ran after threads of the threadgroup had returned");
}

void worker(Group& g, Launch& launch, unsigned local, uint64_t seed) {
  t_state.rng = seed;
  for (;;) {
    if (local == 0) next_threadgroup(g, launch);
    g.pool.arrive_and_wait("");
    if (g.done) return;
    if (local < g.threads) run_thread(g, launch, local);
    g.pool.arrive_and_wait("");
  }
}

}  // namespace

void threadgroup_barrier() {
  t_state.group->threadgroup.arrive_and_wait(
      "threadgroup_barrier ran after threads of the threadgroup had returned");
  jitter_point();
}

void simdgroup_barrier() {
  t_state.simdgroup->barrier.arrive_and_wait(
      "simdgroup_barrier ran after lanes of its simdgroup had returned");
  jitter_point();
}

const unsigned char* simd_exchange(const void* value, unsigned bytes) {
  SimdGroup& sg = *t_state.simdgroup;
  t_state.parity ^= 1;
  std::memcpy(sg.slots[t_state.parity][t_state.lane], value, bytes);
  sg.barrier.arrive_and_wait("a SIMD collective ran after lanes of its simdgroup had returned");
  jitter_point();
  return &sg.slots[t_state.parity][0][0];
}

unsigned simd_lane() { return t_state.lane; }
unsigned simd_size() { return t_state.simdgroup->lanes; }

void* threadgroup_alloc(int site, unsigned long bytes, unsigned long align) {
  Group& g = *t_state.group;
  std::lock_guard<std::mutex> lock(g.alloc_mutex);
  if (site < 0 || site >= kMaxThreadgroupVariables) fail("too many threadgroup variables");
  if (g.offsets[site] < 0) {
    const unsigned long offset = (g.used + align - 1) / align * align;
    if (offset + bytes > kThreadgroupMemory) {
      char message[128];
      std::snprintf(message, sizeof(message), "threadgroup memory: %lu bytes exceed the %lu-byte limit",
                    offset + bytes, kThreadgroupMemory);
      fail(message);
    }
    g.offsets[site] = long(offset);
    g.used = offset + bytes;
  }
  return g.memory + g.offsets[site];
}

void fail(const char* message) {
  if (g_error) std::snprintf(g_error, size_t(g_error_len), "%s", message);
  std::fflush(nullptr);
  _exit(3);
}

}  // namespace msl::rt

extern "C" int msl_emu_launch(void* const* buffers, const unsigned* dims, unsigned long long seed,
                              int concurrency, int jitter, char* error, int error_len) {
  using namespace msl::rt;
  g_error = error;
  g_error_len = error_len;
  Launch launch;
  launch.buffers = buffers;
  launch.seed = seed;
  launch.jitter = jitter;
  unsigned total = 1, workers = 1;
  for (int d = 0; d < 3; ++d) {
    launch.grid[d] = dims[d];
    if (dims[d] == 0 || dims[3 + d] == 0) fail("grid and threadgroup sizes must be positive");
    launch.dispatch[d] = std::min(dims[3 + d], dims[d]);  // MLX: group_dims = min(threadgroup, grid)
    launch.groups_per_grid[d] = (dims[d] + launch.dispatch[d] - 1) / launch.dispatch[d];
    total *= launch.groups_per_grid[d];
    workers *= launch.dispatch[d];
  }
  if (workers > 1024) fail("more than 1024 threads per threadgroup");
  uint64_t rng = seed;
  launch.order.resize(total);
  for (unsigned i = 0; i < total; ++i) launch.order[i] = i;
  for (unsigned i = total; i > 1; --i) std::swap(launch.order[i - 1], launch.order[splitmix(rng) % i]);
  g_launch = &launch;

  const unsigned groups = std::min<unsigned>(unsigned(std::max(concurrency, 1)), total);
  std::vector<std::unique_ptr<Group>> pool;
  std::vector<std::thread> threads;
  for (unsigned g = 0; g < groups; ++g) {
    pool.emplace_back(new Group(workers));
    for (unsigned local = 0; local < workers; ++local)
      threads.emplace_back(worker, std::ref(*pool.back()), std::ref(launch), local, splitmix(rng));
  }
  for (auto& t : threads) t.join();
  return 0;
}
