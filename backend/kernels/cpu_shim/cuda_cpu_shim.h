// CUDA-on-CPU shim: builds a kernel's own .cu source with g++ and runs its grid on the CPU.
//
// Model: every CUDA thread of a block is a ucontext fiber on one OS thread; blocks are
// spread over a few OS worker threads. __syncthreads is a barrier over all threads of
// the block, warp shuffles exchange values through a per-warp barrier, __shared__
// variables are static thread_local (one copy per worker, i.e. per running block).
// The shim is strict: a barrier that not every thread of the block (or warp) reaches is
// reported as a deadlock, shuffles need the full mask and a whole warp.
#pragma once
#define LP_CPU_SHIM 1

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  dim3(unsigned int a = 1, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
};

static constexpr int warpSize = 32;

namespace lp_cpu {

constexpr size_t kStackBytes = 64 * 1024;

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  uint3 tid;
  int linear = 0;
  bool done = false;
};

struct Barrier {
  int count = 0;
  unsigned int gen = 0;
  int size = 0;
};

struct Worker {
  std::vector<Fiber> fibers;
  ucontext_t sched;
  Fiber* current = nullptr;
  dim3 grid, block;
  uint3 block_idx;
  Barrier block_bar;
  std::vector<Barrier> warp_bars;
  std::vector<unsigned long long> slots;  // [warp][parity][lane] shuffle exchange
  const std::function<void()>* body = nullptr;
  bool progress = false;
  std::string error;
};

inline thread_local Worker* tls_worker = nullptr;

inline Worker& worker() { return *tls_worker; }

inline void fail(const std::string& msg) {
  Worker& w = worker();
  if (w.error.empty()) w.error = msg;
  swapcontext(&w.current->ctx, &w.sched);  // never resumed after an error
}

inline void fiber_main() {
  Worker& w = worker();
  w.progress = true;
  (*w.body)();
  w.current->done = true;
  w.progress = true;
}  // returns to w.sched through uc_link

// Arrive at a barrier; yield to the other fibers until everyone has arrived.
inline void wait_on(Barrier& b) {
  Worker& w = worker();
  const unsigned int gen = b.gen;
  if (++b.count == b.size) {
    b.count = 0;
    ++b.gen;
    w.progress = true;
    return;
  }
  Fiber* me = w.current;
  do {
    swapcontext(&me->ctx, &w.sched);
  } while (b.gen == gen);
  w.progress = true;
}

inline void run_block(Worker& w) {
  const int n = static_cast<int>(w.fibers.size());
  w.block_bar = Barrier{0, 0, n};
  const int warps = (n + 31) / 32;
  w.warp_bars.assign(warps, Barrier{});
  for (int i = 0; i < warps; ++i) w.warp_bars[i].size = std::min(32, n - i * 32);
  w.slots.assign(static_cast<size_t>(warps) * 64, 0ull);
  for (Fiber& f : w.fibers) {
    f.done = false;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &w.sched;
    makecontext(&f.ctx, fiber_main, 0);
  }
  int live = n;
  while (live > 0) {
    w.progress = false;
    for (Fiber& f : w.fibers) {
      if (f.done) continue;
      w.current = &f;
      swapcontext(&w.sched, &f.ctx);
      if (!w.error.empty()) return;
      if (f.done) --live;
    }
    if (live > 0 && !w.progress) {
      char buf[160];
      snprintf(buf, sizeof buf,
               "deadlock in block (%u,%u,%u): a __syncthreads or warp shuffle is not reached "
               "by every thread",
               w.block_idx.x, w.block_idx.y, w.block_idx.z);
      w.error = buf;
      return;
    }
  }
}

inline int run_grid(dim3 grid, dim3 block, const std::function<void()>& body, char* err,
                    int errlen) {
  auto report = [&](const std::string& msg) {
    if (err && errlen > 0) snprintf(err, errlen, "%s", msg.c_str());
    return 1;
  };
  const long long threads = 1ll * block.x * block.y * block.z;
  const long long blocks = 1ll * grid.x * grid.y * grid.z;
  if (threads < 1 || threads > 1024) return report("invalid block size");
  if (blocks < 1 || grid.y > 65535 || grid.z > 65535) return report("invalid grid size");
  const long long hw = std::max(1u, std::thread::hardware_concurrency());
  const int nworkers = static_cast<int>(std::min(hw, blocks));
  std::atomic<long long> next{0};
  std::atomic<bool> stop{false};
  std::mutex err_mutex;
  std::string first_error;
  auto work = [&]() {
    Worker w;
    tls_worker = &w;
    w.grid = grid;
    w.block = block;
    w.body = &body;
    w.fibers.resize(threads);
    for (int t = 0; t < threads; ++t) {
      Fiber& f = w.fibers[t];
      f.stack.reset(new char[kStackBytes]);
      f.linear = t;
      f.tid = uint3{static_cast<unsigned>(t % block.x),
                    static_cast<unsigned>((t / block.x) % block.y),
                    static_cast<unsigned>(t / (block.x * block.y))};
    }
    for (;;) {
      const long long b = next.fetch_add(1);
      if (b >= blocks || stop.load()) break;
      w.block_idx = uint3{static_cast<unsigned>(b % grid.x),
                          static_cast<unsigned>((b / grid.x) % grid.y),
                          static_cast<unsigned>(b / (1ll * grid.x * grid.y))};
      run_block(w);
      if (!w.error.empty()) {
        std::lock_guard<std::mutex> lock(err_mutex);
        if (first_error.empty()) first_error = w.error;
        stop.store(true);
        break;
      }
    }
    tls_worker = nullptr;
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < nworkers; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  return first_error.empty() ? 0 : report(first_error);
}

template <typename... P, size_t... I>
std::tuple<std::decay_t<P>...> unpack(void** params, std::index_sequence<I...>) {
  return std::tuple<std::decay_t<P>...>(*static_cast<std::decay_t<P>*>(params[I])...);
}

// Run kernel k over dims = {grid x,y,z, block x,y,z}; params as in cuLaunchKernel.
template <typename... P>
int launch(void (*k)(P...), const unsigned int* dims, void** params, char* err, int errlen) {
  const auto args = unpack<P...>(params, std::index_sequence_for<P...>{});
  const std::function<void()> body = [&]() { std::apply(k, args); };
  return run_grid(dim3(dims[0], dims[1], dims[2]), dim3(dims[3], dims[4], dims[5]), body, err,
                  errlen);
}

// Exchange a value across the warp: every lane posts var, then reads lane src's.
template <typename T>
T exchange(unsigned int mask, T var, int src) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  Worker& w = worker();
  if (mask != 0xffffffffu) fail("warp shuffle with a partial mask is not emulated");
  if (w.fibers.size() % 32 != 0) fail("warp shuffle in a block that is not whole warps");
  const int lane = w.current->linear % 32;
  const int warp = w.current->linear / 32;
  Barrier& b = w.warp_bars[warp];
  unsigned long long* slot = &w.slots[(static_cast<size_t>(warp) * 2 + (b.gen & 1)) * 32];
  unsigned long long bits = 0;
  memcpy(&bits, &var, sizeof(T));
  slot[lane] = bits;
  wait_on(b);
  T out;
  memcpy(&out, &slot[src], sizeof(T));
  return out;
}

inline int lane_id() { return worker().current->linear % 32; }

}  // namespace lp_cpu

#define threadIdx (::lp_cpu::worker().current->tid)
#define blockIdx (::lp_cpu::worker().block_idx)
#define blockDim (::lp_cpu::worker().block)
#define gridDim (::lp_cpu::worker().grid)

inline void __syncthreads() { lp_cpu::wait_on(lp_cpu::worker().block_bar); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  if (mask != 0xffffffffu) lp_cpu::fail("__syncwarp with a partial mask is not emulated");
  lp_cpu::Worker& w = lp_cpu::worker();
  lp_cpu::wait_on(w.warp_bars[w.current->linear / 32]);
}

template <typename T>
T __shfl_sync(unsigned int mask, T var, int src_lane, int width = 32) {
  const int lane = lp_cpu::lane_id();
  const int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
  return lp_cpu::exchange(mask, var, src);
}
template <typename T>
T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = 32) {
  const int lane = lp_cpu::lane_id();
  int src = lane ^ lane_mask;
  if (src >= ((lane & ~(width - 1)) + width) || src > 31) src = lane;
  return lp_cpu::exchange(mask, var, src);
}
template <typename T>
T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
  const int lane = lp_cpu::lane_id();
  int src = lane + static_cast<int>(delta);
  if (src >= (lane & ~(width - 1)) + width) src = lane;
  return lp_cpu::exchange(mask, var, src);
}
template <typename T>
T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
  const int lane = lp_cpu::lane_id();
  int src = lane - static_cast<int>(delta);
  if (src < (lane & ~(width - 1))) src = lane;
  return lp_cpu::exchange(mask, var, src);
}

// Atomics: real atomics, since blocks run on several OS threads.
inline float atomicAdd(float* addr, float val) {
  float old, desired;
  __atomic_load(addr, &old, __ATOMIC_RELAXED);
  do {
    desired = old + val;
  } while (!__atomic_compare_exchange(addr, &old, &desired, false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED));
  return old;
}
inline int atomicAdd(int* addr, int val) { return __atomic_fetch_add(addr, val, __ATOMIC_RELAXED); }
inline unsigned int atomicAdd(unsigned int* addr, unsigned int val) {
  return __atomic_fetch_add(addr, val, __ATOMIC_RELAXED);
}
inline int atomicMax(int* addr, int val) {
  int old = __atomic_load_n(addr, __ATOMIC_RELAXED);
  while (old < val &&
         !__atomic_compare_exchange_n(addr, &old, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}

// Bit casts and math.
inline float __int_as_float(int x) {
  float f;
  memcpy(&f, &x, 4);
  return f;
}
inline float __int_as_float(unsigned int x) { return __int_as_float(static_cast<int>(x)); }
inline float __uint_as_float(unsigned int x) { return __int_as_float(static_cast<int>(x)); }
inline int __float_as_int(float f) {
  int x;
  memcpy(&x, &f, 4);
  return x;
}
inline unsigned int __float_as_uint(float f) { return static_cast<unsigned int>(__float_as_int(f)); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// 16-bit float storage types with round-to-nearest-even conversions.
struct alignas(2) __half {
  unsigned short __x;
};
struct alignas(2) __nv_bfloat16 {
  unsigned short __x;
};

inline float __half2float(const __half h) {
  const unsigned int sign = (h.__x & 0x8000u) << 16;
  const unsigned int e = (h.__x >> 10) & 0x1fu;
  const unsigned int m = h.__x & 0x3ffu;
  if (e == 0) {
    const float v = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24
    return sign ? -v : v;
  }
  const unsigned int bits = e == 31 ? (sign | 0x7f800000u | (m << 13))
                                    : (sign | ((e + 112u) << 23) | (m << 13));
  return __uint_as_float(bits);
}

inline __half __float2half(const float f) {
  unsigned int x = __float_as_uint(f);
  const unsigned short sign = static_cast<unsigned short>((x >> 16) & 0x8000u);
  unsigned int ax = x & 0x7fffffffu;
  __half h;
  if (ax >= 0x7f800000u) {
    h.__x = sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
  } else if (ax >= 0x477ff000u) {  // rounds to infinity
    h.__x = sign | 0x7c00u;
  } else if (ax < 0x38800000u) {  // half subnormal or zero
    h.__x = sign | static_cast<unsigned short>(nearbyintf(__uint_as_float(ax) * 16777216.0f));
  } else {
    ax += 0xfffu + ((ax >> 13) & 1u);
    h.__x = sign | static_cast<unsigned short>((ax - (112u << 23)) >> 13);
  }
  return h;
}

inline float __bfloat162float(const __nv_bfloat16 h) {
  return __uint_as_float(static_cast<unsigned int>(h.__x) << 16);
}

inline __nv_bfloat16 __float2bfloat16(const float f) {
  unsigned int x = __float_as_uint(f);
  __nv_bfloat16 h;
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    h.__x = static_cast<unsigned short>((x >> 16) | 0x40u);
  } else {
    x += 0x7fffu + ((x >> 16) & 1u);
    h.__x = static_cast<unsigned short>(x >> 16);
  }
  return h;
}

// One exported C entry point per kernel instantiation.
#define LP_CPU_ENTRY(symbol, ...)                                                           \
  extern "C" int symbol(const unsigned int* dims, void** params, char* err, int errlen) { \
    return ::lp_cpu::launch(&__VA_ARGS__, dims, params, err, errlen);                      \
  }
