// Kernels that exercise each feature of the CPU shim; also compiled with NVRTC.
#include "dtypes.h"

// out[b * n + t] = value that thread (n - 1 - t) wrote before the barrier.
__global__ void reverse_in_block(int* out) {
  __shared__ int buf[256];
  const int t = threadIdx.x, n = blockDim.x;
  buf[t] = blockIdx.x * 1000 + t;
  __syncthreads();
  out[blockIdx.x * n + t] = buf[n - 1 - t];
}

// Each row i of out holds one shuffle kind: xor 5, down 3, up 2, idx 7 (width 32 and 8).
__global__ void shuffles(int* out) {
  const int lane = threadIdx.x % 32, base = (threadIdx.x / 32) * 32;
  const int v = 100 * (threadIdx.x / 32) + lane;
  out[0 * 64 + base + lane] = __shfl_xor_sync(LP_FULL_MASK, v, 5);
  out[1 * 64 + base + lane] = __shfl_down_sync(LP_FULL_MASK, v, 3);
  out[2 * 64 + base + lane] = __shfl_up_sync(LP_FULL_MASK, v, 2);
  out[3 * 64 + base + lane] = __shfl_sync(LP_FULL_MASK, v, 7);
  out[4 * 64 + base + lane] = __shfl_xor_sync(LP_FULL_MASK, v, 5, 8);
  out[5 * 64 + base + lane] = __shfl_down_sync(LP_FULL_MASK, v, 3, 8);
  out[6 * 64 + base + lane] = __shfl_sync(LP_FULL_MASK, v, 7, 8);
  out[7 * 64 + base + lane] = (int)warp_sum((float)v);
  out[8 * 64 + base + lane] = (int)group_max((float)v, 4);
}

// Every thread of every block adds 1 and its block index to total[0], total[1].
__global__ void atomics(float* total, int* count) {
  atomicAdd(&total[0], 1.0f);
  atomicAdd(&total[1], (float)blockIdx.x);
  atomicAdd(count, 1);
}

// ids[linear thread of grid][6] = threadIdx.xyz, blockIdx.xyz; dims = blockDim, gridDim.
__global__ void indices(int* ids, int* dims) {
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  int* row = ids + (block * threads + t) * 6;
  row[0] = threadIdx.x; row[1] = threadIdx.y; row[2] = threadIdx.z;
  row[3] = blockIdx.x; row[4] = blockIdx.y; row[5] = blockIdx.z;
  if (block == 0 && t == 0) {
    dims[0] = blockDim.x; dims[1] = blockDim.y; dims[2] = blockDim.z;
    dims[3] = gridDim.x; dims[4] = gridDim.y; dims[5] = gridDim.z;
  }
}

// Round-trip floats through T: out[i] = from_float<T>(x[i]), back[i] = to_float(out[i]).
template <typename T>
__global__ void convert(T* out, float* back, const float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    out[i] = from_float<T>(x[i]);
    back[i] = to_float(out[i]);
  }
}

// expf, fmaxf, rsqrtf of x into out[3 * i + 0..2].
__global__ void math(float* out, const float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    out[3 * i] = expf(x[i]);
    out[3 * i + 1] = fmaxf(x[i], 0.5f);
    out[3 * i + 2] = rsqrtf(fabsf(x[i]) + 1.0f);
  }
}

// Thread 0 skips the barrier: a deadlock the shim must report.
__global__ void divergent_barrier(int* out) {
  if (threadIdx.x != 0) __syncthreads();
  out[threadIdx.x] = 1;
}

// A shuffle with a partial mask, which the shim refuses.
__global__ void partial_mask(int* out) {
  out[threadIdx.x] = __shfl_sync(0xffffu, (int)threadIdx.x, 0);
}
