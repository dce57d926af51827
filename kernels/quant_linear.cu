// Quantized linear layers: out = x @ W^T + bias, W [N, K] stored as FP8 (e4m3) or INT4 (W4A16) and
// dequantized on the fly. Every weight is rounded to the activation type T (the weight a model in T
// holds), products and sums are fp32, the bias is added in fp32 and the result rounded once to T:
// reference.fp8_linear / w4a16_linear, up to the order of the fp32 sums.
//
// Weight formats (layouts: backend/kernels/quant_args.py), both rows of row_bytes bytes:
//   Fp8Weights: w uint8 [N, K] (e4m3fn bits); scale float32, the scale of W[n, k] at
//     scale[(n / rows) * cols + k / inputs] (per tensor, per output channel, or per block).
//   Int4Weights<S>: q uint8 [N, ceil(K / 2)] (k in byte k / 2, the low nibble for even k); scales S and
//     zeros uint8 [N, groups], W[n, k] = (q - zeros[n, k / group]) * scales[n, k / group].
//
// Kernels (x [M, K] and out [M, N] row-major; splits = gridDim.z):
//   quant_gemv<T, F, MR>: decode rows. A warp owns kGemvRowsPerWarp rows of W for MR rows of x; a lane
//     reads 16 bytes of each of its W rows at once (vec) with one scale run per load, dequantizes them
//     in registers and multiplies them with each x row. grid (ceil(N / kGemvRows), ceil(M / MR), splits),
//     block kGemvThreads.
//   quant_gemm<T, F>: prefill rows (T half or bfloat16). Tiles of kTileM x kTileN outputs over kTileK
//     inputs: x copied and W dequantized into shared memory as T, then warp tensor-core products
//     (mma.sync m16n8k16, fp32 accumulators; emulated lane by lane under the CPU shim). grid
//     (ceil(N / kTileN), ceil(M / kTileM), splits), block kGemmThreads.
//   quant_dequant<T, F>: W rows [n0, n0 + gridDim.x) into T [rows, K] (dequantize, then torch's GEMM).
//     grid (rows, ceil(K / kDequantThreads)), block kDequantThreads.
// With splits > 1, split z sums inputs [z * split_k, (z + 1) * split_k) into partial[z] (float32
// [splits, M, N], bias not added); the launcher adds the splits in a fixed order (deterministic).
// vec (GEMV, GEMM): the launcher's promise that 16-byte loads are aligned, a load's elements share one
// scale and the scale runs along k are 1 << shift inputs long (or cover K); otherwise every element is
// read byte by byte with its own scale (odd shapes).
#include "dtypes.h"

namespace quant {
constexpr int kGemvWarps = 4;
constexpr int kGemvRowsPerWarp = 2;
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kGemvRows = kGemvWarps * kGemvRowsPerWarp;  // rows of W (output columns) per block
constexpr int kTileM = 64;
constexpr int kTileN = 64;
constexpr int kTileK = 32;
constexpr int kGemmThreads = 128;  // 2 x 2 warps of 32 x 32 outputs
constexpr int kPad = 8;            // T elements after each shared row: conflict-free fragment reads
constexpr int kDequantThreads = 256;
}  // namespace quant

// v rounded to T and back (identity for float).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

// Half hi (0: low, 1: high) of a 32-bit word holding two T (half or bfloat16), as a float.
template <typename T>
__device__ __forceinline__ float half_of(unsigned int word, int hi) {
  T v;
  v.__x = (unsigned short)(word >> (16 * hi));
  return to_float(v);
}

// Bits of a T pair: the lower index in the low half.
template <typename T>
__device__ __forceinline__ unsigned int bits_of(T v) {
  return v.__x;
}

// T constants for two 4-bit values in one word: T(kMagic | q) is kBase + q exactly, kNegBase | z is
// -(kBase + z), kOne is 1.
template <typename T>
struct PairBits;
template <>
struct PairBits<__half> {
  static constexpr unsigned int kMagic = 0x6400u, kNegBase = 0xe400u, kOne = 0x3c00u;  // base 1024
};
template <>
struct PairBits<__nv_bfloat16> {
  static constexpr unsigned int kMagic = 0x4300u, kNegBase = 0xc300u, kOne = 0x3f80u;  // base 128
};

// a * b + c on both halves of T pairs, rounded once to T. The callers' operands make a * b + c exact in
// float (small integers, or a small integer times a T), so the shim's float arithmetic is exact too.
#ifdef LP_CPU_SHIM
template <typename T>
__device__ unsigned int fma2(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int out = 0;
  for (int h = 0; h < 2; ++h)
    out |= bits_of(from_float<T>(half_of<T>(a, h) * half_of<T>(b, h) + half_of<T>(c, h))) << (16 * h);
  return out;
}
// a and b rounded to T and back.
template <typename T>
__device__ __forceinline__ void round_pair(float& a, float& b) {
  a = round_to<T>(a);
  b = round_to<T>(b);
}
#else
template <typename T>
__device__ unsigned int fma2(unsigned int a, unsigned int b, unsigned int c);
template <>
__device__ __forceinline__ unsigned int fma2<__half>(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
template <>
__device__ __forceinline__ unsigned int fma2<__nv_bfloat16>(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
template <typename T>
__device__ __forceinline__ void round_pair(float& a, float& b) {  // float: nothing to round
}
template <>
__device__ __forceinline__ void round_pair<__half>(float& a, float& b) {
  unsigned int d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(b), "f"(a));  // the first source goes to the high half
  a = half_of<__half>(d, 0);
  b = half_of<__half>(d, 1);
}
template <>
__device__ __forceinline__ void round_pair<__nv_bfloat16>(float& a, float& b) {
  unsigned int d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(b), "f"(a));
  a = half_of<__nv_bfloat16>(d, 0);
  b = half_of<__nv_bfloat16>(d, 1);
}
#endif

// The values of two e4m3fn bytes (bits 8-15 and 24-31 of v, the rest zero) times 2^-8 as a half pair:
// the sign to bit 15, exponent and mantissa one bit right. Exact for every finite value, subnormals
// included (the NaN encoding reads as 480).
__device__ __forceinline__ unsigned int fp8_pair(unsigned int v) {
  return (v & 0x80008000u) | ((v & 0x7f007f00u) >> 1);
}

struct Fp8Weights {
  typedef float Scale;
  static constexpr int kPerByte = 1;
  struct Run {
    float s;  // the scale times 2^8 (fp8_pair's values are 2^-8 of the weight's)
  };
  const unsigned char* data;
  const float* scale;
  long long row_bytes;
  int rows, inputs, cols;

  __device__ Fp8Weights(const unsigned char* w, const float* sc, const unsigned char*, long long rb, int p0,
                        int p1, int p2)
      : data(w), scale(sc), row_bytes(rb), rows(p0), inputs(p1), cols(p2) {}
  // the scales of row n start at row_base(n); run i along k (inputs i * run_len() ...) is row_base(n) + i
  __device__ __forceinline__ long long row_base(int n) const { return (long long)(n / rows) * cols; }
  __device__ __forceinline__ int run_len() const { return inputs; }
  template <typename T>
  __device__ __forceinline__ Run run(long long i) const {
    return Run{scale[i] * 256.f};
  }
  // element e (always 0) of a byte, rounded to T
  template <typename T>
  __device__ __forceinline__ float value(unsigned int byte, int, const Run& r) const {
    return round_to<T>(half_of<__half>(fp8_pair(byte << 8), 0) * r.s);
  }
  // the 4 elements of a word (byte i: element i), rounded to T
  template <typename T>
  __device__ __forceinline__ void word(unsigned int w, const Run& r, float* out) const {
    const unsigned int even = fp8_pair(w << 8), odd = fp8_pair(w);  // bytes 0 and 2; 1 and 3
    out[0] = half_of<__half>(even, 0) * r.s;
    out[2] = half_of<__half>(even, 1) * r.s;
    out[1] = half_of<__half>(odd, 0) * r.s;
    out[3] = half_of<__half>(odd, 1) * r.s;
    round_pair<T>(out[0], out[1]);
    round_pair<T>(out[2], out[3]);
  }
};

template <typename S>
struct Int4Weights {
  typedef S Scale;
  static constexpr int kPerByte = 2;
  struct Run {
    float s, c;          // the group's scale; 2^23 + its zero
    unsigned int s2, c2;  // packed path: the scale twice; -(base + zero) twice
  };
  const unsigned char* data;
  const S* scales;
  const unsigned char* zeros;
  long long row_bytes;
  int group, groups;

  // T pairs serve the dequantization when the scales are in T: (q - z) * s rounded once to T either way
  template <typename T>
  struct Packed {
    static constexpr bool value = SameType<S, T>::value && !SameType<T, float>::value;
  };

  __device__ Int4Weights(const unsigned char* q, const S* sc, const unsigned char* z, long long rb, int p0,
                         int p1, int)
      : data(q), scales(sc), zeros(z), row_bytes(rb), group(p0), groups(p1) {}
  __device__ __forceinline__ long long row_base(int n) const { return (long long)n * groups; }
  __device__ __forceinline__ int run_len() const { return group; }
  template <typename T>
  __device__ __forceinline__ Run run(long long i) const {
    Run r{to_float(scales[i]), 8388608.f + (float)zeros[i], 0u, 0u};
    if constexpr (Packed<T>::value) {
      r.s2 = bits_of(scales[i]) * 0x10001u;
      r.c2 = (PairBits<T>::kNegBase | zeros[i]) * 0x10001u;
    }
    return r;
  }
  // nibble e of a byte: (2^23 + q) - (2^23 + z) is q - z exactly, times the scale (exact), rounded to T
  template <typename T>
  __device__ __forceinline__ float value(unsigned int byte, int e, const Run& r) const {
    const float d = __uint_as_float(0x4b000000u | ((byte >> (4 * e)) & 15u)) - r.c;
    return round_to<T>(d * r.s);
  }
  // the 8 elements of a word (nibble i: element i), rounded to T
  template <typename T>
  __device__ __forceinline__ void word(unsigned int w, const Run& r, float* out) const {
    if constexpr (Packed<T>::value) {
      // nibbles i and i + 4 as the pair (base + q): minus (base + z) is q - z, times s rounds once to T
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const unsigned int q2 = ((w >> (4 * i)) & 0x000f000fu) | (PairBits<T>::kMagic * 0x10001u);
        const unsigned int d2 = fma2<T>(q2, PairBits<T>::kOne * 0x10001u, r.c2);
        const unsigned int w2 = fma2<T>(d2, r.s2, 0x80008000u);  // + (-0): the product, rounded
        out[i] = half_of<T>(w2, 0);
        out[i + 4] = half_of<T>(w2, 1);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = value<T>(w >> (4 * i), 0, r);
    }
  }
};

// NB (8 or 16) bytes from an NB-aligned address, as words.
template <int NB>
__device__ __forceinline__ void load_words(const unsigned char* p, unsigned int* words) {
  if (NB == 16) {
    const lp_u128 v = *reinterpret_cast<const lp_u128*>(p);
    words[0] = (unsigned int)v.lo;
    words[1] = (unsigned int)(v.lo >> 32);
    words[2] = (unsigned int)v.hi;
    words[3] = (unsigned int)(v.hi >> 32);
  } else {
    const unsigned long long v = *reinterpret_cast<const unsigned long long*>(p);
    words[0] = (unsigned int)v;
    words[1] = (unsigned int)(v >> 32);
  }
}

// Eight consecutive elements of x as floats; p 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* out) {
  constexpr int V = 16 / sizeof(T);
#pragma unroll
  for (int i = 0; i < 8; i += V) load_floats<T, V>(p + i, out + i);
}

template <typename T, typename F, int MR>
__global__ void __launch_bounds__(quant::kGemvThreads)
    quant_gemv(T* out, float* partial, const T* x, const float* bias, int has_bias, const unsigned char* w,
               const typename F::Scale* scales, const unsigned char* zeros, long long row_bytes, int p0, int p1,
               int p2, int M, int N, int K, int split_k, int vec, int shift) {
  constexpr int RPW = quant::kGemvRowsPerWarp;
  constexpr int E = 16 * F::kPerByte;  // elements of one 16-byte load
  constexpr int PER_WORD = 4 * F::kPerByte;
  const F f(w, scales, zeros, row_bytes, p0, p1, p2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_first = blockIdx.x * quant::kGemvRows + warp * RPW;
  const int m0 = blockIdx.y * MR;
  const int rows = lp_min(MR, M - m0);
  const int k_begin = blockIdx.z * split_k, k_end = lp_min(K, k_begin + split_k);
  int n_of[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) n_of[r] = lp_min(n_first + r, N - 1);  // rows past N: computed, not written
  float acc[MR][RPW];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[m][r] = 0.f;

  if (vec) {
    long long base[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) base[r] = f.row_base(n_of[r]);
    for (int k = k_begin + lane * E; k < k_end; k += 32 * E) {
      unsigned int words[RPW][4];
      typename F::Run run[RPW];
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        load_words<16>(f.data + n_of[r] * f.row_bytes + k / F::kPerByte, words[r]);
        run[r] = f.template run<T>(base[r] + (k >> shift));
      }
#pragma unroll
      for (int sub = 0; sub < E; sub += 8) {
        float wv[RPW][8];
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
          for (int j = 0; j < 8; j += PER_WORD) f.template word<T>(words[r][(sub + j) / PER_WORD], run[r], wv[r] + j);
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          if (m < rows) {
            float xv[8];
            load8<T>(x + (long long)(m0 + m) * K + k + sub, xv);
#pragma unroll
            for (int r = 0; r < RPW; ++r)
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[m][r] += xv[e] * wv[r][e];
          }
        }
      }
    }
  } else {
    // one byte of each row a lane: its kPerByte elements, each with its own scale
    const int b_end = (k_end + F::kPerByte - 1) / F::kPerByte;
    for (int b = k_begin / F::kPerByte + lane; b < b_end; b += 32) {
#pragma unroll
      for (int e = 0; e < F::kPerByte; ++e) {
        const int k = b * F::kPerByte + e;
        if (k >= k_end) break;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const unsigned int byte = f.data[n_of[r] * f.row_bytes + b];
          const float wk = f.template value<T>(byte, e, f.template run<T>(f.row_base(n_of[r]) + k / f.run_len()));
#pragma unroll
          for (int m = 0; m < MR; ++m)
            if (m < rows) acc[m][r] += to_float(x[(long long)(m0 + m) * K + k]) * wk;
        }
      }
    }
  }

#pragma unroll
  for (int m = 0; m < MR; ++m) {
    if (m >= rows) break;  // the same for the whole warp
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const float s = warp_sum(acc[m][r]);
      const int n = n_first + r;
      if (lane == 0 && n < N) {
        const long long o = (long long)(m0 + m) * N + n;
        if (gridDim.z > 1) partial[(long long)blockIdx.z * M * N + o] = s;
        else out[o] = from_float<T>(s + (has_bias ? bias[n] : 0.f));
      }
    }
  }
}

// d (16 x 8, fp32) += a (16 x 16, row-major) * b (16 x 8, column-major), T half or bfloat16, one warp:
// PTX mma.sync.aligned.m16n8k16 with its fragment layout (g = lane / 4, t = lane % 4):
//   a[0]: A[g][2t..2t+1], a[1]: A[g+8][2t..2t+1], a[2]: A[g][2t+8..2t+9], a[3]: A[g+8][2t+8..2t+9];
//   b[0]: B[2t..2t+1][g], b[1]: B[2t+8..2t+9][g]; c[i]: C[g + 8 * (i / 2)][2t + i % 2];
// each 32-bit register holds two elements, the lower index in its low half.
#ifdef LP_CPU_SHIM
template <typename T>
__device__ void mma_16816(float* c, const unsigned int* a, const unsigned int* b) {
  static thread_local unsigned int frag[32][32][6];  // [warp][lane][a0..a3, b0, b1] of the running block
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = 0; i < 4; ++i) frag[warp][lane][i] = a[i];
  frag[warp][lane][4] = b[0];
  frag[warp][lane][5] = b[1];
  __syncwarp();
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float sum = c[i];
    for (int k = 0; k < 16; ++k) {
      const unsigned int aw = frag[warp][(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)];
      const unsigned int bw = frag[warp][col * 4 + (k % 8) / 2][4 + k / 8];
      sum += half_of<T>(aw, k % 2) * half_of<T>(bw, k % 2);
    }
    c[i] = sum;
  }
  __syncwarp();
}
#else
template <typename T>
__device__ void mma_16816(float* c, const unsigned int* a, const unsigned int* b);

template <>
__device__ __forceinline__ void mma_16816<__half>(float* c, const unsigned int* a, const unsigned int* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* c, const unsigned int* a, const unsigned int* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

template <typename T>
__device__ __forceinline__ unsigned int pair_at(const T* p) {
  return *reinterpret_cast<const unsigned int*>(p);
}

// A shared tile of R rows of C elements, 16-byte aligned (vector stores of x, 32-bit fragment reads).
template <typename T, int R, int C>
struct alignas(16) SharedTile {
  T v[R][C];
};

template <typename T, typename F>
__global__ void __launch_bounds__(quant::kGemmThreads)
    quant_gemm(T* out, float* partial, const T* x, const float* bias, int has_bias, const unsigned char* w,
               const typename F::Scale* scales, const unsigned char* zeros, long long row_bytes, int p0, int p1,
               int p2, int M, int N, int K, int split_k, int vec, int shift) {
  using namespace quant;
  constexpr int LD = kTileK + kPad;
  constexpr int HALF = kTileK / 2;  // inputs a thread loads per tile row
  __shared__ SharedTile<T, kTileM, LD> s_x;
  __shared__ SharedTile<T, kTileN, LD> s_w;
  const F f(w, scales, zeros, row_bytes, p0, p1, p2);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4, wm = warp / 2, wn = warp % 2;
  const int m0 = blockIdx.y * kTileM, n0 = blockIdx.x * kTileN;
  const int k_begin = blockIdx.z * split_k, k_end = lp_min(K, k_begin + split_k);
  const int lr = tid / 2, lk = (tid % 2) * HALF;  // the tile row and inputs this thread loads
  const long long w_base = f.row_base(lp_min(n0 + lr, N - 1));
  const T zero = from_float<T>(0.f);

  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  for (int k0 = k_begin; k0 < k_end; k0 += kTileK) {
    __syncthreads();  // the previous tile has been consumed
    {
      const int m = m0 + lr, k = k0 + lk;
      T* dst = &s_x.v[lr][lk];
      if (vec && m < M && k + HALF <= k_end) {
        const T* src = x + (long long)m * K + k;
        *reinterpret_cast<Vec<T, 8>*>(dst) = load_vec<T, 8>(src);
        *reinterpret_cast<Vec<T, 8>*>(dst + 8) = load_vec<T, 8>(src + 8);
      } else {
        for (int e = 0; e < HALF; ++e) dst[e] = m < M && k + e < k_end ? x[(long long)m * K + k + e] : zero;
      }
    }
    {
      const int n = n0 + lr, k = k0 + lk;
      T* dst = &s_w.v[lr][lk];
      if (vec && n < N && k + HALF <= k_end) {
        unsigned int words[4];
        load_words<HALF / F::kPerByte>(f.data + n * f.row_bytes + k / F::kPerByte, words);
        const typename F::Run run = f.template run<T>(w_base + (k >> shift));
        float wv[HALF];
#pragma unroll
        for (int j = 0; j < HALF; j += 4 * F::kPerByte) f.template word<T>(words[j / (4 * F::kPerByte)], run, wv + j);
#pragma unroll
        for (int e = 0; e < HALF; ++e) dst[e] = from_float<T>(wv[e]);
      } else {
        for (int e = 0; e < HALF; ++e) {
          const int kk = k + e;
          dst[e] = n < N && kk < k_end
                       ? from_float<T>(f.template value<T>(f.data[n * f.row_bytes + kk / F::kPerByte],
                                                           kk % F::kPerByte,
                                                           f.template run<T>(f.row_base(n) + kk / f.run_len())))
                       : zero;
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < kTileK; ks += 16) {
      unsigned int a[2][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = wm * 32 + i * 16 + g;
        a[i][0] = pair_at(&s_x.v[r][ks + 2 * t]);
        a[i][1] = pair_at(&s_x.v[r + 8][ks + 2 * t]);
        a[i][2] = pair_at(&s_x.v[r][ks + 2 * t + 8]);
        a[i][3] = pair_at(&s_x.v[r + 8][ks + 2 * t + 8]);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = wn * 32 + j * 8 + g;
        b[j][0] = pair_at(&s_w.v[c][ks + 2 * t]);
        b[j][1] = pair_at(&s_w.v[c][ks + 2 * t + 8]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_16816<T>(acc[i][j], a[i], b[j]);
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m0 + wm * 32 + i * 16 + g + 8 * (e / 2);
        const int n = n0 + wn * 32 + j * 8 + 2 * t + e % 2;
        if (m < M && n < N) {
          const long long o = (long long)m * N + n;
          if (gridDim.z > 1) partial[(long long)blockIdx.z * M * N + o] = acc[i][j][e];
          else out[o] = from_float<T>(acc[i][j][e] + (has_bias ? bias[n] : 0.f));
        }
      }
}

template <typename T, typename F>
__global__ void __launch_bounds__(quant::kDequantThreads)
    quant_dequant(T* dst, const unsigned char* w, const typename F::Scale* scales, const unsigned char* zeros,
                  long long row_bytes, int p0, int p1, int p2, int n0, int K) {
  const F f(w, scales, zeros, row_bytes, p0, p1, p2);
  const int n = n0 + blockIdx.x;
  const int k = blockIdx.y * quant::kDequantThreads + threadIdx.x;
  if (k >= K) return;
  const unsigned int byte = f.data[n * f.row_bytes + k / F::kPerByte];
  const typename F::Run run = f.template run<T>(f.row_base(n) + k / f.run_len());
  dst[(long long)blockIdx.x * K + k] = from_float<T>(f.template value<T>(byte, k % F::kPerByte, run));
}
