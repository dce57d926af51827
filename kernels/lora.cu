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
                            int num_tokens, int h_in, int max_rank) {
  __shared__ int s_slot[TILE];
  const int n = load_tile_slots<TILE>(s_slot, slot_of, num_tokens);
  const int t0 = blockIdx.x * TILE;
  const int lane = threadIdx.x % 32;
  const int r = blockIdx.y * lora::kShrinkWarps + threadIdx.x / 32;
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
          if (lane == 0) out[(long long)(t0 + i + k) * max_rank + r] = from_float<T>(s);
        }
      }
    } else if (lane == 0) {
      for (int k = i; k < j; ++k) out[(long long)(t0 + k) * max_rank + r] = from_float<T>(0.f);
    }
    i = j;
  }
}

template <typename T, int VEC, int TILE, typename SlotOf>
__device__ void expand_tile(T* y, const T* v, const T* b, const int* ranks, const float* scales,
                            SlotOf slot_of, int num_tokens, int h_out, int max_rank, int v_cols) {
  __shared__ int s_slot[TILE];
  __shared__ float s_v[TILE][lora::kRankChunk];
  const int n = load_tile_slots<TILE>(s_slot, slot_of, num_tokens);
  const int t0 = blockIdx.x * TILE;
  const int o = blockIdx.y * blockDim.x + threadIdx.x;
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
          s_v[k][c] = c < cn ? to_float(v[(long long)(t0 + i + k) * v_cols + c0 + c]) : 0.f;
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
            T* p = y + (long long)(t0 + i + k) * h_out + o;
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
  shrink_tile<T, VEC, TILE>(out, x, a, ranks, TokenSlots{token_slots}, num_tokens, h_in, max_rank);
}

// grid (ceil(T / kSgmvTile), ceil(R / kShrinkWarps)), block 32 * kShrinkWarps.
template <typename T, int VEC>
__global__ void __launch_bounds__(32 * lora::kShrinkWarps)
    shrink_sgmv(T* out, const T* x, const T* a, const int* ranks, const int* seg_starts,
                const int* seg_slots, int num_segs, int num_tokens, int h_in, int max_rank) {
  shrink_tile<T, VEC, lora::kSgmvTile>(out, x, a, ranks,
                                       SegmentSlots{seg_starts, seg_slots, num_segs},
                                       num_tokens, h_in, max_rank);
}

// grid (ceil(T / TILE), ceil(h_out / kExpandThreads)), block kExpandThreads.
template <typename T, int VEC, int TILE = lora::kBgmvTile>
__global__ void __launch_bounds__(lora::kExpandThreads)
    expand_bgmv(T* y, const T* v, const T* b, const int* ranks, const float* scales,
                const int* token_slots, int num_tokens, int h_out, int max_rank, int v_cols) {
  expand_tile<T, VEC, TILE>(y, v, b, ranks, scales, TokenSlots{token_slots}, num_tokens, h_out,
                            max_rank, v_cols);
}

// grid (ceil(T / kSgmvTile), ceil(h_out / kExpandThreads)), block kExpandThreads.
template <typename T, int VEC>
__global__ void __launch_bounds__(lora::kExpandThreads)
    expand_sgmv(T* y, const T* v, const T* b, const int* ranks, const float* scales,
                const int* seg_starts, const int* seg_slots, int num_segs, int num_tokens,
                int h_out, int max_rank, int v_cols) {
  expand_tile<T, VEC, lora::kSgmvTile>(y, v, b, ranks, scales,
                                       SegmentSlots{seg_starts, seg_slots, num_segs},
                                       num_tokens, h_out, max_rank, v_cols);
}
