// Element types and float conversions shared by every kernel source.
//
// Under NVRTC this header needs no CUDA toolkit headers: __half and __nv_bfloat16 are
// defined here as 16-bit storage types, converted with PTX cvt instructions (sm_80+),
// unless the toolkit's cuda_fp16.h / cuda_bf16.h were included first. Under the CPU
// shim (LP_CPU_SHIM) the shim header provides the same types and functions.
#pragma once

#ifndef LP_CPU_SHIM

#ifndef __CUDA_FP16_H__
struct alignas(2) __half {
  unsigned short __x;
};
__device__ __forceinline__ float __half2float(const __half h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.__x));
  return f;
}
__device__ __forceinline__ __half __float2half(const float f) {
  __half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.__x) : "f"(f));
  return h;
}
#endif  // __CUDA_FP16_H__

#ifndef __CUDA_BF16_H__
struct alignas(2) __nv_bfloat16 {
  unsigned short __x;
};
__device__ __forceinline__ float __bfloat162float(const __nv_bfloat16 h) {
  return __uint_as_float(static_cast<unsigned int>(h.__x) << 16);
}
__device__ __forceinline__ __nv_bfloat16 __float2bfloat16(const float f) {
  __nv_bfloat16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.__x) : "f"(f));
  return h;
}
#endif  // __CUDA_BF16_H__

#endif  // LP_CPU_SHIM

#define LP_FULL_MASK 0xffffffffu
#define LP_NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// N elements loaded or stored together (16 bytes for N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Load N consecutive elements in one access; p must be aligned to sizeof(T) * N.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& pack, float* out) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(pack.v[i]);
}

// Load N consecutive elements as floats; p must be aligned to sizeof(T) * N.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* p, float* out) {
  to_floats<T, N>(load_vec<T, N>(p), out);
}

// Raw 16-byte unit for dtype-agnostic copies.
struct alignas(16) lp_u128 {
  unsigned long long lo, hi;
};

__device__ __forceinline__ int lp_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int lp_max(int a, int b) { return a > b ? a : b; }

// Reduce over aligned groups of `width` lanes (width a power of two <= 32).
__device__ __forceinline__ float group_sum(float x, int width) {
  for (int o = width / 2; o > 0; o /= 2) x += __shfl_xor_sync(LP_FULL_MASK, x, o);
  return x;
}
__device__ __forceinline__ float group_max(float x, int width) {
  for (int o = width / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(LP_FULL_MASK, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) { return group_sum(x, 32); }
__device__ __forceinline__ float warp_max(float x) { return group_max(x, 32); }
