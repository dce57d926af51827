// Paged-attention prefill: new tokens attend causally to themselves and their cached prefix.
//
// Simple tiled kernel. A block serves BQ consecutive new tokens of one sequence and one
// query head. Key/value tiles of BK tokens are gathered from the paged cache into shared
// memory; a warp takes its queries one by one, a lane scores one key of the tile, and the
// warp keeps an online softmax with the output row spread over its lanes.
// Blocks are numbered over all sequences' query tiles in order; a block finds its
// sequence by walking cu_query_lens (grid.x is an upper bound; spare blocks exit).
//
// Shapes: q, out [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
// block_tables int32 [B, max_blocks]; cu_query_lens int32 [B + 1]; context_lens int32 [B]
// (cached tokens including the new ones; new token i of a sequence sits at position
// context_len - query_len + i).
// window > 0: the query at position p sees only the keys at positions > p - window; a block
// loads no key before its first query's window (block-table entries included). softcap > 0:
// scores are softcap * tanh(score / softcap) (Gemma 2), before the mask and the softmax.
#include "dtypes.h"

template <int D>
struct PrefillTile {
  static constexpr int BK = D <= 128 ? 32 : 16;  // keys per shared tile
  static constexpr int BQ = D <= 128 ? 16 : 8;   // queries per block
  static constexpr int WARPS = 4;
  static constexpr int QPW = BQ / WARPS;  // queries per warp
  static constexpr int EPL = D / 32;      // output elements per lane
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
};

// grid (num_tiles_upper_bound, Hq), block 32 * PrefillTile<D>::WARPS.
template <typename T, int D>
__global__ void __launch_bounds__(128)
    paged_prefill(T* out, const T* q, const T* k_cache, const T* v_cache, const int* block_tables,
                  const int* cu_query_lens, const int* context_lens, int num_seqs,
                  int num_q_heads, int num_kv_heads, int block_size, int max_blocks,
                  float scale, int window, float softcap) {
  using P = PrefillTile<D>;
  __shared__ float s_q[P::BQ][D];
  __shared__ float s_k[P::BK][D + 1];
  __shared__ float s_v[P::BK][D];

  int rest = blockIdx.x, seq = -1, tile = 0;
  for (int b = 0; b < num_seqs; ++b) {
    const int tiles = (cu_query_lens[b + 1] - cu_query_lens[b] + P::BQ - 1) / P::BQ;
    if (rest < tiles) {
      seq = b;
      tile = rest;
      break;
    }
    rest -= tiles;
  }
  if (seq < 0) return;  // the same for every thread of the block

  const int hq = blockIdx.y;
  const int kvh = hq / (num_q_heads / num_kv_heads);
  const int qlen = cu_query_lens[seq + 1] - cu_query_lens[seq];
  const int ctx = context_lens[seq];
  const int tok0 = cu_query_lens[seq] + tile * P::BQ;
  const int nq = lp_min(P::BQ, qlen - tile * P::BQ);
  const int pos0 = ctx - qlen + tile * P::BQ;  // position of the tile's first query
  const int last = pos0 + nq - 1;
  const int first = window > 0 ? lp_max(0, pos0 - window + 1) : 0;  // the tile's first visible key
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int* table = block_tables + (long long)seq * max_blocks;

  for (int i = threadIdx.x; i < P::BQ * D; i += blockDim.x) {
    const int r = i / D, d = i % D;
    s_q[r][d] = r < nq ? to_float(q[((long long)(tok0 + r) * num_q_heads + hq) * D + d]) * scale : 0.f;
  }

  float m[P::QPW], l[P::QPW], acc[P::QPW][P::EPL];
#pragma unroll
  for (int k = 0; k < P::QPW; ++k) {
    m[k] = LP_NEG_INF;
    l[k] = 0.f;
#pragma unroll
    for (int e = 0; e < P::EPL; ++e) acc[k][e] = 0.f;
  }

  for (int k0 = first - first % P::BK; k0 <= last; k0 += P::BK) {
    __syncthreads();  // queries loaded / previous tile consumed
    for (int i = threadIdx.x; i < P::BK * D; i += blockDim.x) {
      const int j = i / D, d = i % D;
      const int key = k0 + j;
      float kx = 0.f, vx = 0.f;
      if (key >= first && key <= last) {
        const long long blk = table[key / block_size];
        const long long idx = ((blk * block_size + key % block_size) * num_kv_heads + kvh) * D + d;
        kx = to_float(k_cache[idx]);
        vx = to_float(v_cache[idx]);
      }
      s_k[j][d] = kx;
      s_v[j][d] = vx;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < P::QPW; ++k) {
      const int r = warp + k * P::WARPS;  // query row within the tile
      if (r >= nq) continue;
      const int pos = pos0 + r;
      float s = LP_NEG_INF;
      const int key = k0 + lane;
      if (lane < P::BK && key <= pos && (window <= 0 || key > pos - window)) {
        float dot = 0.f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) dot += s_q[r][d] * s_k[lane][d];
        s = softcap > 0.f ? tanhf(dot / softcap) * softcap : dot;
      }
      const float tmax = warp_max(s);
      if (tmax == LP_NEG_INF) continue;
      const float mx = fmaxf(m[k], tmax);
      const float corr = expf(m[k] - mx);
      const float p = s == LP_NEG_INF ? 0.f : expf(s - mx);
      l[k] = l[k] * corr + warp_sum(p);
#pragma unroll
      for (int e = 0; e < P::EPL; ++e) acc[k][e] *= corr;
      for (int j = 0; j < P::BK; ++j) {
        const float pj = __shfl_sync(LP_FULL_MASK, p, j);
#pragma unroll
        for (int e = 0; e < P::EPL; ++e) acc[k][e] += pj * s_v[j][lane + 32 * e];
      }
      m[k] = mx;
    }
  }

#pragma unroll
  for (int k = 0; k < P::QPW; ++k) {
    const int r = warp + k * P::WARPS;
    if (r >= nq) continue;
    T* dst = out + ((long long)(tok0 + r) * num_q_heads + hq) * D;
#pragma unroll
    for (int e = 0; e < P::EPL; ++e)
      dst[lane + 32 * e] = from_float<T>(l[k] > 0.f ? acc[k][e] / l[k] : 0.f);
  }
}
