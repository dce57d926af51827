// LoRA shrink (out = x @ A^T) and expand (y += scale * v @ B^T) over per-token adapter slots.
//
// BGMV: every token names its slot (decode). SGMV: contiguous segments share a slot
// (prefill). A block takes a tile of consecutive tokens and handles each run of equal
// slots in it together, so a tile of one adapter reads each A/B row once. Work follows
// each adapter's own rank: rank rows r >= ranks[slot] are written as zero (shrink) or
// never read (expand). Slot -1 means no adapter.
//
// Shapes: x [T, h_in], a [S, R, h_in], out [T, R]; v [T, v_cols], b [S, h_out, R],
// y [T, h_out]; ranks int32 [S]; scales float32 [S].
#include "dtypes.h"

namespace lora {
constexpr int kShrinkWarps = 4;      // one rank row per warp
constexpr int kExpandThreads = 128;  // one output column per thread
constexpr int kRankChunk = 64;       // rank entries of v staged in shared memory at once
constexpr int kBgmvTile = 4;         // tokens per block, BGMV, by default (1 is instantiated too)
constexpr int kSgmvTile = 16;        // tokens per block, SGMV
}  // namespace lora

// Slot of token t for BGMV.
struct TokenSlots {
  const int* slots;
  __device__ __forceinline__ int operator()(int t) const { return slots[t]; }
};

// Slot of token t for SGMV: segment g with starts[g] <= t < starts[g + 1]; -1 outside.
struct SegmentSlots {
  const int* starts;
  const int* slots;
  int num_segs;
  __device__ __forceinline__ int operator()(int t) const {
    if (num_segs <= 0 || t < starts[0] || t >= starts[num_segs]) return -1;
    int lo = 0, hi = num_segs;  // starts[lo] <= t < starts[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (starts[mid] <= t) lo = mid;
      else hi = mid;
    }
    return slots[lo];
  }
};

// Fill s_slot with the slots of the block's tile; returns the number of tokens in it.
template <int TILE, typename SlotOf>
__device__ __forceinline__ int load_tile_slots(int* s_slot, SlotOf slot_of, int num_tokens) {
  const int t0 = blockIdx.x * TILE;
  const int n = lp_min(TILE, num_tokens - t0);
  if (threadIdx.x < TILE) s_slot[threadIdx.x] = (int)threadIdx.x < n ? slot_of(t0 + threadIdx.x) : -1;
  __syncthreads();
  return n;
}

// End of the run of equal slots starting at i.
__device__ __forceinline__ int run_end(const int* s_slot, int i, int n) {
  int j = i + 1;
  while (j < n && s_slot[j] == s_slot[i]) ++j;
  return j;
}

template <typename T, int VEC, int TILE, typename SlotOf>
__device__ void shrink_tile(T* out, const T* x, const T* a, const int* ranks, SlotOf slot_of,
                            int num_tokens, int h_in, int max_rank, int rank_block, int out_stride) {
  __shared__ int s_slot[TILE];
  const int n = load_tile_slots<TILE>(s_slot, slot_of, num_tokens);
  const int t0 = blockIdx.x * TILE;
  const int lane = threadIdx.x % 32;
  const int r = rank_block * lora::kShrinkWarps + threadIdx.x / 32;
  if (r >= max_rank) return;
  for (int i = 0; i < n;) {
    const int j = run_end(s_slot, i, n);
    const int slot = s_slot[i];
    const int rank = slot < 0 ? 0 : lp_min(ranks[slot], max_rank);
    if (r < rank) {
      float acc[TILE];
#pragma unroll
      for (int k = 0; k < TILE; ++k) acc[k] = 0.f;
      const T* arow = a + ((long long)slot * max_rank + r) * h_in;
#pragma unroll 4
      for (int c = lane * VEC; c < h_in; c += 32 * VEC) {
        float av[VEC];
        load_floats<T, VEC>(arow + c, av);
#pragma unroll
        for (int k = 0; k < TILE; ++k) {
          if (i + k < j) {
            float xv[VEC];
            load_floats<T, VEC>(x + (long long)(t0 + i + k) * h_in + c, xv);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[k] += av[e] * xv[e];
          }
        }
      }
#pragma unroll
      for (int k = 0; k < TILE; ++k) {
        if (i + k < j) {
          const float s = warp_sum(acc[k]);
          if (lane == 0) out[(long long)(t0 + i + k) * out_stride + r] = from_float<T>(s);
        }
      }
    } else if (lane == 0) {
      for (int k = i; k < j; ++k) out[(long long)(t0 + k) * out_stride + r] = from_float<T>(0.f);
    }
    i = j;
  }
}

template <typename T, int VEC, int TILE, typename SlotOf>
__device__ void expand_tile(T* y, const T* v, const T* b, const int* ranks, const float* scales,
                            SlotOf slot_of, int num_tokens, int h_out, int max_rank, int v_cols,
                            int col_block, long long y_stride, int v_stride) {
  __shared__ int s_slot[TILE];
  __shared__ float s_v[TILE][lora::kRankChunk];
  const int n = load_tile_slots<TILE>(s_slot, slot_of, num_tokens);
  const int t0 = blockIdx.x * TILE;
  const int o = col_block * blockDim.x + threadIdx.x;
  for (int i = 0; i < n;) {
    const int j = run_end(s_slot, i, n);
    const int slot = s_slot[i];
    if (slot >= 0) {
      const int rank = lp_min(lp_min(ranks[slot], max_rank), v_cols);
      const float scale = scales[slot];
      float acc[TILE];
#pragma unroll
      for (int k = 0; k < TILE; ++k) acc[k] = 0.f;
      const T* brow = b + ((long long)slot * h_out + o) * max_rank;
      for (int c0 = 0; c0 < rank; c0 += lora::kRankChunk) {
        const int cn = lp_min(lora::kRankChunk, rank - c0);
        __syncthreads();  // the previous chunk has been consumed
        for (int e = threadIdx.x; e < (j - i) * lora::kRankChunk; e += blockDim.x) {
          const int k = e / lora::kRankChunk, c = e % lora::kRankChunk;
          s_v[k][c] = c < cn ? to_float(v[(long long)(t0 + i + k) * v_stride + c0 + c]) : 0.f;
        }
        __syncthreads();
        if (o < h_out) {
          int c = 0;
          for (; c + VEC <= cn; c += VEC) {
            float bv[VEC];
            load_floats<T, VEC>(brow + c0 + c, bv);
#pragma unroll
            for (int k = 0; k < TILE; ++k) {
              if (i + k < j) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[k] += bv[e] * s_v[k][c + e];
              }
            }
          }
          for (; c < cn; ++c) {
            const float bv = to_float(brow[c0 + c]);
#pragma unroll
            for (int k = 0; k < TILE; ++k) {
              if (i + k < j) acc[k] += bv * s_v[k][c];
            }
          }
        }
      }
      if (o < h_out) {
#pragma unroll
        for (int k = 0; k < TILE; ++k) {
          if (i + k < j) {
            T* p = y + (long long)(t0 + i + k) * y_stride + o;
            *p = from_float<T>(to_float(*p) + scale * acc[k]);
          }
        }
      }
    }
    i = j;
  }
}

// grid (ceil(T / TILE), ceil(R / kShrinkWarps)), block 32 * kShrinkWarps. TILE 1: one pass over
// h_in a warp, four times the blocks; TILE 4: a run of equal slots shares each A row read.
template <typename T, int VEC, int TILE = lora::kBgmvTile>
__global__ void __launch_bounds__(32 * lora::kShrinkWarps)
    shrink_bgmv(T* out, const T* x, const T* a, const int* ranks, const int* token_slots,
                int num_tokens, int h_in, int max_rank) {
  shrink_tile<T, VEC, TILE>(out, x, a, ranks, TokenSlots{token_slots}, num_tokens, h_in, max_rank,
                            blockIdx.y, max_rank);
}

// grid (ceil(T / kSgmvTile), ceil(R / kShrinkWarps)), block 32 * kShrinkWarps.
template <typename T, int VEC>
__global__ void __launch_bounds__(32 * lora::kShrinkWarps)
    shrink_sgmv(T* out, const T* x, const T* a, const int* ranks, const int* seg_starts,
                const int* seg_slots, int num_segs, int num_tokens, int h_in, int max_rank) {
  shrink_tile<T, VEC, lora::kSgmvTile>(out, x, a, ranks,
                                       SegmentSlots{seg_starts, seg_slots, num_segs},
                                       num_tokens, h_in, max_rank, blockIdx.y, max_rank);
}

// grid (ceil(T / TILE), ceil(h_out / kExpandThreads)), block kExpandThreads.
template <typename T, int VEC, int TILE = lora::kBgmvTile>
__global__ void __launch_bounds__(lora::kExpandThreads)
    expand_bgmv(T* y, const T* v, const T* b, const int* ranks, const float* scales,
                const int* token_slots, int num_tokens, int h_out, int max_rank, int v_cols) {
  expand_tile<T, VEC, TILE>(y, v, b, ranks, scales, TokenSlots{token_slots}, num_tokens, h_out,
                            max_rank, v_cols, blockIdx.y, h_out, v_cols);
}

// grid (ceil(T / kSgmvTile), ceil(h_out / kExpandThreads)), block kExpandThreads.
template <typename T, int VEC>
__global__ void __launch_bounds__(lora::kExpandThreads)
    expand_sgmv(T* y, const T* v, const T* b, const int* ranks, const float* scales,
                const int* seg_starts, const int* seg_slots, int num_segs, int num_tokens,
                int h_out, int max_rank, int v_cols) {
  expand_tile<T, VEC, lora::kSgmvTile>(y, v, b, ranks, scales,
                                       SegmentSlots{seg_starts, seg_slots, num_segs},
                                       num_tokens, h_out, max_rank, v_cols, blockIdx.y, h_out, v_cols);
}

// Fused group (q/k/v or gate/up: modules that read one input x): up to three modules' A stacks
// [S, R, h_in] (one max rank R) in one launch, out [T, groups * R] with module g in columns
// [g * R, (g + 1) * R). grid (ceil(T / TILE), groups * ceil(R / kShrinkWarps)); unused a2/ranks2 may
// repeat a1/ranks1.
template <typename T, int VEC, int TILE = lora::kBgmvTile>
__global__ void __launch_bounds__(32 * lora::kShrinkWarps)
    shrink_bgmv_group(T* out, const T* x, const T* a0, const T* a1, const T* a2, const int* ranks0,
                      const int* ranks1, const int* ranks2, const int* token_slots, int groups,
                      int num_tokens, int h_in, int max_rank) {
  const int per_module = (max_rank + lora::kShrinkWarps - 1) / lora::kShrinkWarps;
  const int g = blockIdx.y / per_module;
  if (g >= groups) return;
  const T* a = g == 0 ? a0 : (g == 1 ? a1 : a2);
  const int* ranks = g == 0 ? ranks0 : (g == 1 ? ranks1 : ranks2);
  shrink_tile<T, VEC, TILE>(out + g * max_rank, x, a, ranks, TokenSlots{token_slots}, num_tokens, h_in,
                            max_rank, blockIdx.y % per_module, groups * max_rank);
}

// The fused group's expand: y_g [T, h_g] (row stride y_stride_g: views of one fused output are fine)
// += scale_g * v[:, g * R : g * R + rank] @ B_g^T, three modules in one launch. grid (ceil(T / TILE),
// sum_g ceil(h_g / kExpandThreads)), block kExpandThreads; h_g 0 for an absent module.
template <typename T, int VEC, int TILE = lora::kBgmvTile>
__global__ void __launch_bounds__(lora::kExpandThreads)
    expand_bgmv_group(T* y0, T* y1, T* y2, const T* v, const T* b0, const T* b1, const T* b2,
                      const int* ranks0, const int* ranks1, const int* ranks2, const float* scales0,
                      const float* scales1, const float* scales2, const int* token_slots, int groups,
                      int num_tokens, int h0, int h1, int h2, long long ys0, long long ys1, long long ys2,
                      int max_rank) {
  const int n0 = (h0 + lora::kExpandThreads - 1) / lora::kExpandThreads;
  const int n1 = (h1 + lora::kExpandThreads - 1) / lora::kExpandThreads;
  int g = 0, col_block = blockIdx.y;
  if (col_block >= n0) { g = 1; col_block -= n0; }
  if (g == 1 && col_block >= n1) { g = 2; col_block -= n1; }
  if (g >= groups) return;
  T* y = g == 0 ? y0 : (g == 1 ? y1 : y2);
  const T* b = g == 0 ? b0 : (g == 1 ? b1 : b2);
  const int* ranks = g == 0 ? ranks0 : (g == 1 ? ranks1 : ranks2);
  const float* scales = g == 0 ? scales0 : (g == 1 ? scales1 : scales2);
  const int h_out = g == 0 ? h0 : (g == 1 ? h1 : h2);
  const long long y_stride = g == 0 ? ys0 : (g == 1 ? ys1 : ys2);
  expand_tile<T, VEC, TILE>(y, v + g * max_rank, b, ranks, scales, TokenSlots{token_slots}, num_tokens, h_out,
                            max_rank, max_rank, col_block, y_stride, groups * max_rank);
}

// Split-K shrink for few rows over many input features: one token per block, h_in cut into
// gridDim.z slices of `chunk` features; slice z's dot products go to partial[z] (float32 [splits, T, R],
// every entry written; zero past a row's rank), summed by the launcher in a fixed order (deterministic:
// a graph's replay equals the eager step). grid (T, ceil(R / kShrinkWarps), splits), block 32 * kShrinkWarps.
template <typename T, int VEC>
__global__ void __launch_bounds__(32 * lora::kShrinkWarps)
    shrink_bgmv_split(float* partial, const T* x, const T* a, const int* ranks, const int* token_slots,
                      int num_tokens, int h_in, int max_rank, int chunk) {
  const int t = blockIdx.x;
  const int lane = threadIdx.x % 32;
  const int r = blockIdx.y * lora::kShrinkWarps + threadIdx.x / 32;
  if (t >= num_tokens || r >= max_rank) return;
  float* dst = partial + ((long long)blockIdx.z * num_tokens + t) * max_rank + r;
  const int slot = token_slots[t];
  if (slot < 0 || r >= lp_min(ranks[slot], max_rank)) {
    if (lane == 0) *dst = 0.f;
    return;
  }
  const int c_begin = blockIdx.z * chunk, c_end = lp_min(h_in, c_begin + chunk);
  const T* arow = a + ((long long)slot * max_rank + r) * h_in;
  const T* xrow = x + (long long)t * h_in;
  float acc = 0.f;
  for (int c = c_begin + lane * VEC; c < c_end; c += 32 * VEC) {
    float av[VEC], xv[VEC];
    load_floats<T, VEC>(arow + c, av);
    load_floats<T, VEC>(xrow + c, xv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc += av[e] * xv[e];
  }
  const float s = warp_sum(acc);
  if (lane == 0) *dst = s;
}
