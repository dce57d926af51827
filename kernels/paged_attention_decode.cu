// Paged-attention decode: one query token per sequence over its cached context.
//
// A block serves one KV head, up to QPB of the query heads that share it (GQA: each K/V
// row is read once for all of them), one sequence, and one split of the context.
// Lanes form groups of LANES; a group reads one token's K/V row with 16-byte loads, so a
// warp covers 32 / LANES tokens per step, and issues the loads of kUnroll steps before
// using them. Each group keeps an online-softmax state (max, sum, weighted V) in log2
// units (q is pre-scaled by log2(e), so one exp2 per token and query); groups, then
// warps, are merged at the end. With one split the block writes the output; with several
// (flash-decoding) it writes its partial state and paged_decode_reduce merges the splits.
// window > 0: the query (at position ctx - 1) sees only the keys at positions > ctx - 1 - window;
// nothing before them is read, block-table entries included (splits wholly before them stay
// empty). softcap > 0: scores are softcap * tanh(score / softcap) (Gemma 2), q then pre-scaled
// by scale only and the capped score put in log2 units.
//
// Shapes: q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
// block_tables int32 [B, max_blocks]; context_lens int32 [B]; out [B, Hq, D];
// partial_acc float32 [B, Hq, S, D]; partial_ml float32 [B, Hq, S, 2] (max in log2 units, sum).
#include "dtypes.h"

namespace decode {
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kUnroll = 2;  // token steps per warp whose loads are in flight together
constexpr float kLog2e = 1.4426950408889634f;
}  // namespace decode

template <typename T, int D>
struct DecodeLayout {
  static constexpr int VEC = 16 / sizeof(T);                   // elements per load
  static constexpr int NVL = D / VEC > 32 ? D / VEC / 32 : 1;  // loads per lane per row
  static constexpr int LANES = D / (VEC * NVL);                // lanes per token
  static constexpr int TPW = 32 / LANES;                       // tokens per warp step
  static constexpr int EPL = VEC * NVL;                        // row elements per lane
  static_assert(D % VEC == 0 && 32 % LANES == 0, "unsupported head dim");
};

// Element e (0 <= e < EPL) of lane-in-group lg sits at row offset elem_offset(lg, e).
template <typename L>
__device__ __forceinline__ int elem_offset(int lg, int e) {
  return ((e / L::VEC) * L::LANES + lg) * L::VEC + e % L::VEC;
}

// Merge online-softmax state (m2, l2, a2) into (m, l, a).
template <int N>
__device__ __forceinline__ void merge_state(float& m, float& l, float* a, float m2, float l2,
                                            const float* a2) {
  const float mx = fmaxf(m, m2);
  if (mx == LP_NEG_INF) return;
  const float c1 = m == LP_NEG_INF ? 0.f : exp2f(m - mx);
  const float c2 = m2 == LP_NEG_INF ? 0.f : exp2f(m2 - mx);
  l = l * c1 + l2 * c2;
#pragma unroll
  for (int e = 0; e < N; ++e) a[e] = a[e] * c1 + a2[e] * c2;
  m = mx;
}

// grid (Hkv * ceil(G / QPB), B, num_splits), block decode::kThreads.
template <typename T, int D, int QPB>
__global__ void __launch_bounds__(decode::kThreads)
    paged_decode(T* out, float* partial_acc, float* partial_ml, const T* q, const T* k_cache,
                 const T* v_cache, const int* block_tables, const int* context_lens,
                 int num_q_heads, int num_kv_heads, int block_size, int max_blocks,
                 int split_tokens, int num_splits, float scale, int window, float softcap) {
  using L = DecodeLayout<T, D>;
  __shared__ float s_m[decode::kWarps][QPB];
  __shared__ float s_l[decode::kWarps][QPB];
  __shared__ float s_acc[decode::kWarps][QPB][D];

  const int group = num_q_heads / num_kv_heads;
  const int chunks = (group + QPB - 1) / QPB;
  const int kvh = blockIdx.x / chunks;
  const int chunk = blockIdx.x % chunks;
  const int head0 = kvh * group + chunk * QPB;
  const int nq = lp_min(QPB, group - chunk * QPB);
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int ctx = context_lens[seq];
  const int t_begin = lp_max(split * split_tokens, window > 0 ? ctx - window : 0);
  const int t_end = lp_min(ctx, (split + 1) * split_tokens);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lg = lane % L::LANES, tg = lane / L::LANES;

  const bool capped = softcap > 0.f;
  const float qscale = capped ? scale : scale * decode::kLog2e;
  float qv[QPB][L::EPL];
#pragma unroll
  for (int g = 0; g < QPB; ++g) {
#pragma unroll
    for (int v = 0; v < L::NVL; ++v) {
      if (g < nq) {
        const T* src = q + ((long long)seq * num_q_heads + head0 + g) * D + (v * L::LANES + lg) * L::VEC;
        load_floats<T, L::VEC>(src, &qv[g][v * L::VEC]);
#pragma unroll
        for (int e = 0; e < L::VEC; ++e) qv[g][v * L::VEC + e] *= qscale;
      } else {
#pragma unroll
        for (int e = 0; e < L::VEC; ++e) qv[g][v * L::VEC + e] = 0.f;
      }
    }
  }

  float m[QPB], l[QPB], acc[QPB][L::EPL];
#pragma unroll
  for (int g = 0; g < QPB; ++g) {
    m[g] = LP_NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < L::EPL; ++e) acc[g][e] = 0.f;
  }

  const int* table = block_tables + (long long)seq * max_blocks;
  constexpr int kStep = decode::kWarps * L::TPW;  // tokens the block covers per step
  for (int base = t_begin + warp * L::TPW; base < t_end; base += kStep * decode::kUnroll) {
    Vec<T, L::VEC> kraw[decode::kUnroll][L::NVL], vraw[decode::kUnroll][L::NVL];
    bool valid[decode::kUnroll];
#pragma unroll
    for (int u = 0; u < decode::kUnroll; ++u) {
      const int t = base + u * kStep + tg;
      valid[u] = t < t_end;
      if (valid[u]) {
        const long long blk = table[t / block_size];
        const long long row = ((blk * block_size + t % block_size) * num_kv_heads + kvh) * D;
#pragma unroll
        for (int v = 0; v < L::NVL; ++v) {
          kraw[u][v] = load_vec<T, L::VEC>(k_cache + row + (v * L::LANES + lg) * L::VEC);
          vraw[u][v] = load_vec<T, L::VEC>(v_cache + row + (v * L::LANES + lg) * L::VEC);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < decode::kUnroll; ++u) {
      float kv[L::EPL];
#pragma unroll
      for (int e = 0; e < L::EPL; ++e) kv[e] = 0.f;
      if (valid[u]) {
#pragma unroll
        for (int v = 0; v < L::NVL; ++v) to_floats<T, L::VEC>(kraw[u][v], &kv[v * L::VEC]);
      }
      float s[QPB];
#pragma unroll
      for (int g = 0; g < QPB; ++g) {
        if (g < nq) {
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < L::EPL; ++e) dot += qv[g][e] * kv[e];
          s[g] = group_sum(dot, L::LANES);
          if (capped) s[g] = tanhf(s[g] / softcap) * softcap * decode::kLog2e;
        }
      }
      if (!valid[u]) continue;
#pragma unroll
      for (int v = 0; v < L::NVL; ++v) to_floats<T, L::VEC>(vraw[u][v], &kv[v * L::VEC]);
#pragma unroll
      for (int g = 0; g < QPB; ++g) {
        if (g < nq) {
          // One exp2: the larger of (old max, score) gets weight 1, the other exp2(-gap).
          const float gap = s[g] - m[g];  // +inf while m is -inf
          const float w = exp2f(-fabsf(gap));
          const bool up = gap > 0.f;
          const float corr = up ? w : 1.f;
          const float p = up ? 1.f : w;
          l[g] = l[g] * corr + p;
#pragma unroll
          for (int e = 0; e < L::EPL; ++e) acc[g][e] = acc[g][e] * corr + p * kv[e];
          if (up) m[g] = s[g];
        }
      }
    }
  }

  // Merge the token groups of the warp (lanes lg, lg + LANES, ...).
#pragma unroll
  for (int g = 0; g < QPB; ++g) {
    if (g < nq) {
      for (int o = L::LANES; o < 32; o *= 2) {
        const float m2 = __shfl_xor_sync(LP_FULL_MASK, m[g], o);
        const float l2 = __shfl_xor_sync(LP_FULL_MASK, l[g], o);
        float a2[L::EPL];
#pragma unroll
        for (int e = 0; e < L::EPL; ++e) a2[e] = __shfl_xor_sync(LP_FULL_MASK, acc[g][e], o);
        merge_state<L::EPL>(m[g], l[g], acc[g], m2, l2, a2);
      }
    }
  }
  if (tg == 0) {
#pragma unroll
    for (int g = 0; g < QPB; ++g) {
      if (lg == 0) {
        s_m[warp][g] = m[g];
        s_l[warp][g] = l[g];
      }
#pragma unroll
      for (int e = 0; e < L::EPL; ++e) s_acc[warp][g][elem_offset<L>(lg, e)] = acc[g][e];
    }
  }
  __syncthreads();

  // Merge the warps; one thread per (query head, element).
  for (int i = threadIdx.x; i < nq * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float mx = LP_NEG_INF;
    for (int w = 0; w < decode::kWarps; ++w) mx = fmaxf(mx, s_m[w][g]);
    float sum = 0.f, val = 0.f;
    if (mx != LP_NEG_INF) {
      for (int w = 0; w < decode::kWarps; ++w) {
        const float c = s_m[w][g] == LP_NEG_INF ? 0.f : exp2f(s_m[w][g] - mx);
        sum += s_l[w][g] * c;
        val += s_acc[w][g][d] * c;
      }
    }
    const long long head = (long long)seq * num_q_heads + head0 + g;
    if (num_splits == 1) {
      out[head * D + d] = from_float<T>(sum > 0.f ? val / sum : 0.f);
    } else {
      partial_acc[(head * num_splits + split) * D + d] = val;
      if (d == 0) {
        partial_ml[(head * num_splits + split) * 2] = mx;
        partial_ml[(head * num_splits + split) * 2 + 1] = sum;
      }
    }
  }
}

// Merge the splits of paged_decode: grid (Hq, B), block D threads.
template <typename T, int D>
__global__ void __launch_bounds__(256)
    paged_decode_reduce(T* out, const float* partial_acc, const float* partial_ml,
                        int num_q_heads, int num_splits) {
  const long long head = (long long)blockIdx.y * num_q_heads + blockIdx.x;
  const int d = threadIdx.x;
  const float* ml = partial_ml + head * num_splits * 2;
  float mx = LP_NEG_INF;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, ml[2 * s]);
  float sum = 0.f, val = 0.f;
  if (mx != LP_NEG_INF) {
    for (int s = 0; s < num_splits; ++s) {
      if (ml[2 * s] == LP_NEG_INF) continue;
      const float c = exp2f(ml[2 * s] - mx);
      sum += ml[2 * s + 1] * c;
      val += partial_acc[(head * num_splits + s) * D + d] * c;
    }
  }
  out[head * D + d] = from_float<T>(sum > 0.f ? val / sum : 0.f);
}
