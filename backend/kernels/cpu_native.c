/* Native CPU ops of the decode step (fp32): one call where torch takes several small ops.
 *
 * Built by cpu_native.py with cc -O3 -march=native -ffp-contract=off -fopenmp (no FMA contraction
 * outside the explicit ones: the elementwise ops round like torch's), loaded with ctypes. Rows may be
 * strided (views of a fused projection's output); the last dimension is contiguous.
 * Single-threaded except the decode attention and the GEMM, which run on torch's OpenMP pool with
 * lp_set_threads' count (their own: torch's ops may use fewer).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* Threads of the parallel loops (the GEMM's panels, decode attention's sequences); 0: OpenMP's, i.e. torch's. */
static int lp_thread_count = 0;
void lp_set_threads(int n) { lp_thread_count = n > 0 ? n : 0; }
int lp_threads(void) { return lp_thread_count > 0 ? lp_thread_count : omp_get_max_threads(); }

/* The vector path: AVX-512, else AVX2 with F16C and FMA, LANES floats a register. Without either LANES is
 * undefined: the ops run scalar and the fp16 GEMM is not offered. */
#if defined(__AVX512F__)
#define LANES 16
#define TILE_ROWS 6
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_load_h(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vf_bcast(const float *p) { return _mm512_set1_ps(*p); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_set(float a) { return _mm512_set1_ps(a); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_floor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf vf_pow2i(vf k) { /* 2^k for integral k in [-126, 127] */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23));
}
static inline float vf_sum(vf a) { return _mm512_reduce_add_ps(a); }
static inline unsigned vf_eq_mask(vf a, vf b) { return (unsigned)_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LANES 8
#define TILE_ROWS 3
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load_h(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vf_bcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vf_set(float a) { return _mm256_set1_ps(a); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_floor(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf vf_pow2i(vf k) { /* 2^k for integral k in [-126, 127] */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
}
static inline float vf_sum(vf a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline unsigned vf_eq_mask(vf a, vf b) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
#endif


#define MAX_HEAD_DIM 512

/* out[r] = w * (x[r] * 1/sqrt(mean(x[r]^2) + eps)); with d, first x[r] += d[r] in place (the residual add). */
void lp_add_rms_norm(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w, float *out,
                     int64_t out_stride, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * x_stride, *o = out + r * out_stride;
        if (d) {
            const float *dr = d + r * d_stride;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(sum / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* exp(x) in float (Cephes' expf polynomial, about 1 ulp) for x >= -87.3 (below: about 1e-38, not 0) and
 * x < 88.3; +inf from about 88.4 on. Branch-free. */
static inline float lp_exp(float x) {
    x = x < -87.33654f ? -87.33654f : x;
    x = x > 88.72f ? 88.72f : x;
    const float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)k + 127) << 23; /* 2^k; k = 128 gives +inf */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#ifdef LANES
/* lp_exp on LANES floats, the same polynomial (the same values up to the last bit of the range clamp). */
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set(-87.33654f)), vf_set(88.72f));
    const vf k = vf_floor(vf_add(vf_mul(x, vf_set(1.44269504088896341f)), vf_set(0.5f)));
    vf r = vf_sub(x, vf_mul(k, vf_set(0.693359375f)));
    r = vf_sub(r, vf_mul(k, vf_set(-2.12194440e-4f)));
    vf p = vf_set(1.9875691500e-4f);
    p = vf_add(vf_mul(p, r), vf_set(1.3981999507e-3f));
    p = vf_add(vf_mul(p, r), vf_set(8.3334519073e-3f));
    p = vf_add(vf_mul(p, r), vf_set(4.1665795894e-2f));
    p = vf_add(vf_mul(p, r), vf_set(1.6666665459e-1f));
    p = vf_add(vf_mul(p, r), vf_set(5.0000001201e-1f));
    p = vf_add(vf_add(vf_mul(vf_mul(p, r), r), r), vf_set(1.f));
    return vf_mul(p, vf_pow2i(k));
}
#endif

/* out[r] = silu(gate[r]) * up[r], silu(g) = g / (1 + exp(-g)) as torch computes it. */
void lp_silu_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, float *out,
                 int64_t out_stride, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *o = out + r * out_stride;
        int64_t i = 0;
#ifdef LANES
        for (; i + LANES <= n; i += LANES) {
            const vf gv = vf_load(g + i);
            const vf e = vf_exp(vf_sub(vf_zero(), gv));
            vf_store(o + i, vf_mul(vf_div(gv, vf_add(vf_set(1.f), e)), vf_load(u + i)));
        }
#endif
        for (; i < n; i++) o[i] = g[i] / (1.f + lp_exp(-g[i])) * u[i];
    }
}

/* x[t, h] = x * cos[pos[t]] + roll(x, D/2) * signed_sin[pos[t]] in place, for the heads of each row. */
static void rotate_rows(float *x, int64_t row_stride, int64_t heads, int64_t d, const int64_t *positions,
                        int64_t rows, const float *cos, const float *signed_sin) {
    const int64_t half = d / 2;
    float tmp[MAX_HEAD_DIM];
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + positions[t] * d, *s = signed_sin + positions[t] * d;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * row_stride + h * d;
            memcpy(tmp, v, (size_t)d * sizeof(float));
#pragma omp simd
            for (int64_t i = 0; i < half; i++) v[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
#pragma omp simd
            for (int64_t i = half; i < d; i++) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
        }
    }
}

/* RoPE on q [T, Hq, D] and k [T, Hkv, D] in place (rows strided, heads contiguous), by positions [T]
 * into tables [table_rows, D]. Returns 0, or -1 (nothing rotated) when a position is outside the tables. */
int lp_rotate_qk(float *q, int64_t q_stride, int64_t hq, float *k, int64_t k_stride, int64_t hkv, int64_t d,
                 const int64_t *positions, int64_t rows, const float *cos, const float *signed_sin,
                 int64_t table_rows) {
    if (d > MAX_HEAD_DIM || d % 2) return -1;
    for (int64_t t = 0; t < rows; t++)
        if (positions[t] < 0 || positions[t] >= table_rows) return -1;
    rotate_rows(q, q_stride, hq, d, positions, rows, cos, signed_sin);
    rotate_rows(k, k_stride, hkv, d, positions, rows, cos, signed_sin);
    return 0;
}

/* cache rows slot_mapping[t] (of Hkv * D floats) = k[t], v[t]; a negative slot is skipped.
 * Returns 0, or -1 (nothing written) when a slot is past the cache's cache_rows rows. */
int lp_write_kv(float *k_cache, float *v_cache, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                const int64_t *slot_mapping, int64_t rows, int64_t row_elems, int64_t cache_rows) {
    for (int64_t t = 0; t < rows; t++)
        if (slot_mapping[t] >= cache_rows) return -1;
    for (int64_t t = 0; t < rows; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_elems, k + t * k_stride, (size_t)row_elems * sizeof(float));
        memcpy(v_cache + slot * row_elems, v + t * v_stride, (size_t)row_elems * sizeof(float));
    }
    return 0;
}

/* sum of a[i] * b[i] over d floats (fused multiply-adds, in vector lanes, then a tree). */
static inline __attribute__((always_inline)) float dot_fma(const float *a, const float *b, const int64_t d) {
#ifdef LANES
    if (d % LANES == 0) {
        vf acc0 = vf_zero(), acc1 = vf_zero();
        int64_t i = 0;
        for (; i + 2 * LANES <= d; i += 2 * LANES) {
            acc0 = vf_fma(vf_load(a + i), vf_load(b + i), acc0);
            acc1 = vf_fma(vf_load(a + i + LANES), vf_load(b + i + LANES), acc1);
        }
        if (i < d) acc0 = vf_fma(vf_load(a + i), vf_load(b + i), acc0);
        return vf_sum(vf_add(acc0, acc1));
    }
#endif
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < d; i++) dot = fmaf(a[i], b[i], dot);
    return dot;
}

/* s[0..n) = softmax(s) in place: exp(s - max) / sum (a NaN score makes the row NaN). */
static void softmax_inplace(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
    for (int64_t p = 0; p < n; p++) m = s[p] > m ? s[p] : m; /* vmaxps (fmaxf: a libm call); NaN: its exp */
    int64_t p = 0;
#ifdef LANES
    vf vsum = vf_zero();
    const vf vm = vf_set(m);
    for (; p + LANES <= n; p += LANES) {
        const vf e = vf_exp(vf_sub(vf_load(s + p), vm));
        vf_store(s + p, e);
        vsum = vf_add(vsum, e);
    }
    sum = vf_sum(vsum);
#endif
    for (; p < n; p++) {
        s[p] = lp_exp(s[p] - m);
        sum += s[p];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t q = 0; q < n; q++) s[q] *= inv;
}

/* The run of positions from p to the end of p's block or to n: its length (*len) and its first row in the
 * cache. Walking first..n-1 run by run reads no block-table entry before first's block. */
static inline int64_t run_at(const int32_t *blocks, int64_t p, int64_t n, int64_t block_size, int64_t *len) {
    const int64_t off = p % block_size, rest = block_size - off;
    *len = rest < n - p ? rest : n - p;
    return (int64_t)blocks[p / block_size] * block_size + off;
}

/* out[0..d) = sum over positions first..n-1 of w[p - first] * V[p] (V rows read through the block table at
 * column col). */
static inline __attribute__((always_inline)) void weigh_values(const float *w, const float *v_cache,
                                                                const int32_t *blocks, int64_t first, int64_t n,
                                                                int64_t block_size, int64_t row, int64_t col,
                                                                const int64_t d, float *out) {
#ifdef LANES
    if (d % LANES == 0 && d <= 8 * LANES) { /* the sums stay in registers */
        vf acc[8];
        for (int64_t v = 0; v < d / LANES; v++) acc[v] = vf_zero();
        for (int64_t p = first, len; p < n; p += len) {
            const float *vb = v_cache + run_at(blocks, p, n, block_size, &len) * row + col, *wb = w + (p - first);
            for (int64_t off = 0; off < len; off++) {
                const vf wp = vf_set(wb[off]);
                const float *vp = vb + off * row;
                for (int64_t v = 0; v < d / LANES; v++) acc[v] = vf_fma(wp, vf_load(vp + v * LANES), acc[v]);
            }
        }
        for (int64_t v = 0; v < d / LANES; v++) vf_store(out + v * LANES, acc[v]);
        return;
    }
#endif
    memset(out, 0, (size_t)d * sizeof(float));
    for (int64_t p = first, len; p < n; p += len) {
        const float *vb = v_cache + run_at(blocks, p, n, block_size, &len) * row + col, *wb = w + (p - first);
        for (int64_t off = 0; off < len; off++) {
            const float wp = wb[off], *vp = vb + off * row;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) out[i] = fmaf(wp, vp[i], out[i]);
        }
    }
}

/* One sequence's query heads [group, D] of KV head g over its cached positions first..n-1 -> out [group, D].
 * scores holds group * (n - first) floats. Exact softmax: scores (soft-capped when softcap > 0: softcap *
 * tanh(score / softcap), as Gemma 2), their max, exp, then the weighted sum of V. Walks the block table block
 * by block (no division per position); d is a constant where inlined. */
static inline __attribute__((always_inline)) void attend_group_d(
    const float *q, int64_t q_head_stride, float *out, int64_t group, const float *k_cache, const float *v_cache,
    const int32_t *blocks, int64_t first, int64_t n, int64_t block_size, int64_t hkv, int64_t g, const int64_t d,
    float scale, float softcap, float *scores) {
    const int64_t row = hkv * d, m = n - first;
    for (int64_t p = first, len; p < n; p += len) {
        const float *kb = k_cache + run_at(blocks, p, n, block_size, &len) * row + g * d;
        for (int64_t off = 0; off < len; off++) {
            const float *kp = kb + off * row;
            for (int64_t j = 0; j < group; j++) {
                scores[j * m + p - first + off] = dot_fma(q + j * q_head_stride, kp, d) * scale;
            }
        }
    }
    if (softcap > 0.f)
        for (int64_t i = 0; i < group * m; i++) scores[i] = tanhf(scores[i] / softcap) * softcap;
    for (int64_t j = 0; j < group; j++) softmax_inplace(scores + j * m, m);
    for (int64_t j = 0; j < group; j++) weigh_values(scores + j * m, v_cache, blocks, first, n, block_size, row,
                                                     g * d, d, out + j * d);
}

static void attend_group(const float *q, int64_t q_head_stride, float *out, int64_t group, const float *k_cache,
                         const float *v_cache, const int32_t *blocks, int64_t first, int64_t n, int64_t block_size,
                         int64_t hkv, int64_t g, int64_t d, float scale, float softcap, float *scores) {
#define ATTEND(D) attend_group_d(q, q_head_stride, out, group, k_cache, v_cache, blocks, first, n, block_size, hkv, \
                                  g, D, scale, softcap, scores)
    switch (d) { /* the common head dims unrolled */
        case 64: ATTEND(64); break;
        case 128: ATTEND(128); break;
        case 256: ATTEND(256); break;
        default: ATTEND(d);
    }
#undef ATTEND
}

/* The first position a query at position n - 1 sees: n - window with a window (window > 0) shorter than n, else 0. */
static inline int64_t window_start(int64_t n, int64_t window) { return window > 0 && n > window ? n - window : 0; }

/* Paged decode attention: q [B, Hq, D] (rows q_stride apart, heads contiguous), one query per sequence over
 * its context_lens[b] cached positions (with window > 0, the last window of them), found through
 * block_tables [B, max_blocks] (rows table_stride apart; entries of blocks before the window never read)
 * -> out [B, Hq, D]; an empty context gives zeros. softcap > 0 soft-caps the scores (attend_group_d).
 * Work items are (sequence, KV head), spread over torch's OpenMP threads when there are several.
 * Returns 0; -1 (nothing computed) when a context passes its block table or a block the cache's num_blocks;
 * -2 when scratch memory could not be allocated. */
int lp_paged_decode(const float *q, int64_t q_stride, float *out, const float *k_cache, const float *v_cache,
                    const int32_t *block_tables, int64_t table_stride, int64_t max_blocks, const int32_t *context_lens,
                    int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, int64_t num_blocks,
                    float scale, int64_t window, float softcap) {
    const int64_t group = hq / hkv, items = num_seqs * hkv;
    int64_t longest = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t n = context_lens[b], used = (n + block_size - 1) / block_size, first = window_start(n, window);
        if (used > max_blocks) return -1;
        for (int64_t i = first / block_size; i < used; i++)
            if (block_tables[b * table_stride + i] < 0 || block_tables[b * table_stride + i] >= num_blocks) return -1;
        longest = n - first > longest ? n - first : longest;
    }
    int failed = 0;
#pragma omp parallel num_threads(lp_threads()) if (items > 1 && longest * items >= 4096)
    {
        float *scores = (float *)malloc((size_t)(group * (longest > 0 ? longest : 1)) * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t b = item / hkv, g = item % hkv, n = context_lens[b];
            float *o = out + (b * hq + g * group) * d;
            if (n <= 0 || !scores) {
                memset(o, 0, (size_t)(group * d) * sizeof(float));
                continue;
            }
            attend_group(q + b * q_stride + g * group * d, d, o, group, k_cache, v_cache,
                         block_tables + b * table_stride, window_start(n, window), n, block_size, hkv, g, d, scale,
                         softcap, scores);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

/* ---- GEMM over weights in panels: y = x @ W.T + bias, x fp32, W fp16 or fp32, products summed in fp32 ----
 * The weight [N, K] is packed (cpu_native.Panels) as N / NB panels of [K, NB] (N padded with zero rows to a
 * multiple of NB): panel p holds columns p*NB .. p*NB+NB-1 of W.T, so one panel is one stream of memory.
 * Each panel is read once from memory and stays in cache while every tile of TILE_ROWS rows of x passes
 * over it: TILE_ROWS x NB outputs in registers, fp16 weights converted to fp32 by F16C as they are loaded. */
#ifdef LANES
#define PANEL_VECS 4
#define NB (LANES * PANEL_VECS)

static inline __attribute__((always_inline)) vf load_weights(const void *panel, int64_t at, const int half) {
    return half ? vf_load_h((const uint16_t *)panel + at) : vf_load((const float *)panel + at);
}

/* rows (<= TILE_ROWS) x NB outputs over one panel; cols < NB stores only those. rows and half are constants
 * after inlining, so each count and weight type gets its own unrolled loop. */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t x_stride, const void *panel,
                                                             int64_t k, const float *bias, float *y, int64_t y_stride,
                                                             const int rows, int64_t cols, const int half) {
    vf acc[TILE_ROWS][PANEL_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < PANEL_VECS; v++) acc[r][v] = vf_zero();
    for (int64_t i = 0; i < k; i++) {
        vf w[PANEL_VECS];
        for (int v = 0; v < PANEL_VECS; v++) w[v] = load_weights(panel, i * NB + v * LANES, half);
        for (int r = 0; r < rows; r++) {
            const vf xr = vf_bcast(x + r * x_stride + i);
            for (int v = 0; v < PANEL_VECS; v++) acc[r][v] = vf_fma(xr, w[v], acc[r][v]);
        }
    }
    float buf[NB];
    for (int r = 0; r < rows; r++) {
        float *out = cols == NB ? y + r * y_stride : buf;
        for (int v = 0; v < PANEL_VECS; v++)
            vf_store(out + v * LANES, bias ? vf_add(acc[r][v], vf_load(bias + v * LANES)) : acc[r][v]);
        if (cols != NB) memcpy(y + r * y_stride, buf, (size_t)cols * sizeof(float));
    }
}

static inline __attribute__((always_inline)) void gemm_panel(const float *x, int64_t x_stride, const void *panel,
                                                              int64_t k, const float *bias, float *y,
                                                              int64_t y_stride, int64_t m, int64_t cols,
                                                              const int half) {
#define TILE(R) gemm_tile(x + r * x_stride, x_stride, panel, k, bias, y + r * y_stride, y_stride, R, cols, half)
    int64_t r = 0;
    for (; r + TILE_ROWS <= m; r += TILE_ROWS) TILE(TILE_ROWS);
    switch (m - r) { /* the last rows, each count its own unrolled tile */
#if TILE_ROWS > 5
        case 5: TILE(5); break;
        case 4: TILE(4); break;
        case 3: TILE(3); break;
#endif
        case 2: TILE(2); break;
        case 1: TILE(1); break;
        default: break;
    }
#undef TILE
}

static void gemm_panel_f16(const float *x, int64_t x_stride, const void *panel, int64_t k, const float *bias,
                           float *y, int64_t y_stride, int64_t m, int64_t cols) {
    gemm_panel(x, x_stride, panel, k, bias, y, y_stride, m, cols, 1);
}

static void gemm_panel_f32(const float *x, int64_t x_stride, const void *panel, int64_t k, const float *bias,
                           float *y, int64_t y_stride, int64_t m, int64_t cols) {
    gemm_panel(x, x_stride, panel, k, bias, y, y_stride, m, cols, 0);
}
#else
#define NB 0
#endif

/* Panel width NB of the GEMMs, or 0 when this CPU has no vector path for them (then they are not called). */
int lp_gemm_panel_width(void) { return NB; }

/* ---- int8 weights: W = q * scale[n] per output channel, q int8 (decision 071) ----
 * Panels of NB columns as the others, each [KP / 4, NB, 4] (KP: K rounded up to 64, padded with zeros): four
 * consecutive k of a column are one 32-bit lane, so one vector holds LANES columns x 4 k, and 16 rows of a panel
 * at one column tile are an AMX B tile. Three paths:
 * - VNNI (vpdpbusd: 4 products u8 x s8 summed into an int32 lane): each row of x is split into I8_PARTS int8 parts,
 *   x ~ s_1 q_1 + ... + s_P q_P with s_1 = max|x| / 127, s_j+1 = s_j / 254 and q_j the rounded remainder, so
 *   |x - sum| <= s_P / 2 (P = 3: max|x| / 16.4e6, about fp32's own rounding of a product). Parts are stored as
 *   u8 = q + 128: sum_k u8 * w = sum_k q * w + 128 * colsum[n] (stored with the panels, times 128), and
 *   y = scale * (s_1 (acc_1 - colsum) + ... + s_P (acc_P - colsum)) + bias. The int32 sums are exact (|w| <= 128,
 *   u8 <= 255, KP <= I8_MAX_K), so every path that sums them (VNNI, AMX) gives the same values, and each row's
 *   values do not depend on the other rows of the call.
 * - AMX (tdpbusd on tiles: 16 x 64 u8 by 64 x 16 s8), where the CPU and the kernel allow it, for calls of
 *   AMX_MIN_ROWS rows or more: the same parts and sums as VNNI, so the same values.
 * - without VNNI (or forced, lp_int8_force): each weight converted to fp32 in registers, multiplied by x in fp32
 *   (FMA), y = scale * sum + bias: weight-only, x . W up to fp32 rounding. */
#define I8_MAX_K (1 << 16)
#define I8_KP(k) (((k) + 63) & ~(int64_t)63)
enum { LP_F32 = 0, LP_F16 = 1, LP_I8 = 2 };
enum { I8_NONE = 0, I8_CVT = 1, I8_VNNI = 2, I8_AMX = 3 };
#ifndef I8_PARTS
#define I8_PARTS 3 /* int8 parts of each activation (1..3; decision 071: 3 is exact to fp32 rounding) */
#endif
#define AMX_REAL (16 / I8_PARTS)     /* rows of x in an AMX A tile: their parts are its rows */
#define AMX_ROWS (AMX_REAL * I8_PARTS) /* rows of an A / C tile */
#define I8_PAD_ROWS (2 * AMX_REAL)    /* quantized rows are padded to a multiple of this (two A tiles a step) */
#ifndef I8_PREFETCH
#define I8_PREFETCH 2048 /* bytes of the panel the VNNI loop asks for ahead of its loads (0: none) */
#endif
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 2 /* one row: VNNI reads the weights as fast, without the tiles' padding */
#endif

typedef struct { /* one linear layer's weight as the GEMM reads it: panels of kind (LP_*) and, padded to the
                  * panels, its bias (NULL: none) and for int8 its per-column scale and 128 * column sums */
    const void *w;
    const float *bias, *scale;
    const int32_t *colsum;
    int64_t kind;
} lp_weight;

#ifdef LANES
#if defined(__AVX512F__)
typedef __m512i vi;
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vf vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
/* byte J (0..3) of each 32-bit lane, sign-extended, as fp32 */
#define VI_BYTE(w, J) _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32((w), 24 - 8 * (J)), 24))
static inline void vf_store_u8(uint8_t *p, vf integral) { /* integral values in [-128, 127], stored + 128 */
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(integral),
                                                                           _mm512_set1_epi32(128))));
}
#if defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#define I8_ROWS (6 / I8_PARTS) /* rows of a VNNI tile: parts x rows x 4 vectors of sums in registers */
static inline vi vi_bcast4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline vi vi_dpbusd(vi acc, vi u8, vi s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#else
typedef __m256i vi;
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline vf vi_float(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf vf_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
#define VI_BYTE(w, J) _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32((w), 24 - 8 * (J)), 24))
static inline void vf_store_u8(uint8_t *p, vf integral) {
    const __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(integral), _mm256_set1_epi32(128));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(w, w));
}
#if defined(__AVXVNNI__)
#define HAVE_VNNI 1
#define I8_ROWS 1
static inline vi vi_bcast4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline vi vi_dpbusd(vi acc, vi u8, vi s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#endif
#endif
#endif

#ifdef HAVE_AMX
/* Whether this process may use the AMX tiles: Linux grants the tile data state on request (once a process). */
static int amx_allowed(void) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

/* The best int8 path here (AMX only where the kernel grants it), and the one taken: at most lp_int8_force's level,
 * so tests and benchmarks can take each path. -1: not yet decided. */
static int lp_int8_best = -1, lp_int8_level = -1;

static int int8_best(void) {
    if (lp_int8_best < 0) {
#if defined(HAVE_AMX)
        lp_int8_best = amx_allowed() ? I8_AMX : I8_VNNI;
#elif defined(HAVE_VNNI)
        lp_int8_best = I8_VNNI;
#elif defined(LANES)
        lp_int8_best = I8_CVT;
#else
        lp_int8_best = I8_NONE;
#endif
    }
    return lp_int8_best;
}

int lp_int8_isa(void) {
    if (lp_int8_level < 0) lp_int8_level = int8_best();
    return lp_int8_level;
}

/* Cap the int8 path at level (I8_CVT: the fp32 fallback; I8_VNNI; I8_AMX or more: the best here); returns the
 * path taken. */
int lp_int8_force(int level) {
    const int best = int8_best();
    lp_int8_level = best == I8_NONE ? I8_NONE : level < I8_CVT ? I8_CVT : level < best ? level : best;
    return lp_int8_level;
}

/* Bytes of scratch the VNNI and AMX paths need for m rows of k: the rows (padded to I8_PAD_ROWS) of I8_PARTS u8
 * rows of KP bytes each, then each row's I8_PARTS scales. */
static inline int64_t i8_scratch_bytes(int64_t m, int64_t k) {
    const int64_t rows = (m + I8_PAD_ROWS - 1) / I8_PAD_ROWS * I8_PAD_ROWS;
    return rows * I8_PARTS * (I8_KP(k) + (int64_t)sizeof(float));
}

#ifdef HAVE_VNNI
/* Row x (k floats) as I8_PARTS u8 rows of kp bytes into xq (pad: 128, i.e. 0) and their scales into s: part j
 * holds round(r_j / s_j) of the remainder r_j = x - the parts before it (|r_j| <= s_j * 127: no part saturates).
 * A row holding a NaN or an infinity gets NaN scales (its outputs are NaN); a zero row zero scales. */
static void quantize_row(const float *x, int64_t k, int64_t kp, uint8_t *xq, float *s) {
    float amax = 0.f, z = 0.f; /* z: NaN exactly when a value is not finite */
#pragma omp simd reduction(max : amax) reduction(+ : z)
    for (int64_t i = 0; i < k; i++) {
        const float a = x[i] < 0.f ? -x[i] : x[i];
        amax = a > amax ? a : amax;
        z += x[i] * 0.f;
    }
    if (z != z || amax == 0.f) {
        memset(xq, 128, (size_t)(I8_PARTS * kp));
        for (int j = 0; j < I8_PARTS; j++) s[j] = z == z ? 0.f : NAN;
        return;
    }
    double sd[I8_PARTS]; /* in double: the last scale of a tiny amax is subnormal or 0 in float */
    sd[0] = (double)amax / 127.0;
    for (int j = 1; j < I8_PARTS; j++) sd[j] = sd[j - 1] / 254.0;
    for (int j = 0; j < I8_PARTS; j++) s[j] = (float)sd[j];
    if (!(1.0 / sd[I8_PARTS - 1] <= 3.0e38)) { /* amax below ~1e-31: such rows are split in double */
        for (int64_t i = 0; i < k; i++) {
            double r = x[i];
            for (int j = 0; j < I8_PARTS; j++) {
                double q = nearbyint(r / sd[j]);
                q = q < -127 ? -127 : q > 127 ? 127 : q;
                xq[j * kp + i] = (uint8_t)(q + 128);
                r -= q * sd[j];
            }
        }
    } else {
        vf inv[I8_PARTS], sv[I8_PARTS];
        float invs[I8_PARTS];
        for (int j = 0; j < I8_PARTS; j++) invs[j] = (float)(1.0 / sd[j]), inv[j] = vf_set(invs[j]), sv[j] = vf_set(s[j]);
        const vf top = vf_set(127.f), bottom = vf_set(-127.f);
        int64_t i = 0;
        for (; i + LANES <= k; i += LANES) {
            vf r = vf_load(x + i);
            for (int j = 0; j < I8_PARTS; j++) {
                const vf q = vf_min(vf_max(vf_round(vf_mul(r, inv[j])), bottom), top);
                vf_store_u8(xq + j * kp + i, q);
                r = vf_fnmadd(q, sv[j], r);
            }
        }
        for (; i < k; i++) {
            float r = x[i];
            for (int j = 0; j < I8_PARTS; j++) {
                float q = rintf(r * invs[j]);
                q = q < -127.f ? -127.f : q > 127.f ? 127.f : q;
                xq[j * kp + i] = (uint8_t)((int)q + 128);
                r = fmaf(-q, s[j], r);
            }
        }
    }
    for (int j = 0; j < I8_PARTS; j++) memset(xq + j * kp + k, 128, (size_t)(kp - k));
}

/* m rows of x quantized into scratch: rows of I8_PARTS x kp bytes (then room for pad rows up to I8_PAD_ROWS,
 * written when pad: AMX's tiles read them), then the scales [rows][I8_PARTS]. */
static void quantize_rows(const float *x, int64_t x_stride, int64_t m, int64_t k, void *scratch, int pad,
                          uint8_t **xq, float **xs) {
    const int64_t kp = I8_KP(k), rows = (m + I8_PAD_ROWS - 1) / I8_PAD_ROWS * I8_PAD_ROWS;
    *xq = (uint8_t *)scratch;
    *xs = (float *)(*xq + rows * I8_PARTS * kp);
    uint8_t *q = *xq;
    float *s = *xs;
#pragma omp parallel for num_threads(lp_threads()) schedule(static) if (m > 1 && m * k >= (1 << 16))
    for (int64_t r = 0; r < m; r++) quantize_row(x + r * x_stride, k, kp, q + r * I8_PARTS * kp, s + r * I8_PARTS);
    if (pad) memset(*xq + m * I8_PARTS * kp, 128, (size_t)((rows - m) * I8_PARTS * kp));
}

/* out[0..LANES) of one row: scale * (sum over parts of s_j * (acc_j - colsum)) + bias, at column c of the weight
 * (the same order of operations on every path that sums the parts in int32). */
static inline __attribute__((always_inline)) vf i8_combine(const vi *acc, const float *s, const lp_weight *w,
                                                            int64_t c) {
    const vi cs = vi_load(w->colsum + c);
    vf t = vf_mul(vi_float(vi_sub(acc[0], cs)), vf_set(s[0]));
    for (int q = 1; q < I8_PARTS; q++) t = vf_add(t, vf_mul(vi_float(vi_sub(acc[q], cs)), vf_set(s[q])));
    const vf o = vf_mul(t, vf_load(w->scale + c));
    return w->bias ? vf_add(o, vf_load(w->bias + c)) : o;
}

/* rows (<= I8_ROWS) x NB outputs of one int8 panel from quantized rows (xq: [rows][I8_PARTS][kp], xs: their
 * scales [rows][I8_PARTS]) over k4 = K rounded up to 4; col0: the panel's first column. */
static inline __attribute__((always_inline)) void i8_vnni_tile(const uint8_t *xq, int64_t k4, int64_t kp,
                                                                const float *xs, const int8_t *panel,
                                                                const lp_weight *w, int64_t col0, float *y,
                                                                int64_t y_stride, const int rows, int64_t cols) {
    vi acc[I8_ROWS][PANEL_VECS][I8_PARTS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < PANEL_VECS; v++)
            for (int q = 0; q < I8_PARTS; q++) acc[r][v][q] = vi_zero();
    for (int64_t g = 0; g < k4; g += 4) {
        vi wv[PANEL_VECS];
#if I8_PREFETCH
        for (int v = 0; v < PANEL_VECS; v++)
            _mm_prefetch((const char *)panel + g * NB + I8_PREFETCH + v * 64, _MM_HINT_T0);
#endif
        for (int v = 0; v < PANEL_VECS; v++) wv[v] = vi_load(panel + g * NB + v * LANES * 4);
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < I8_PARTS; q++) {
                const vi xb = vi_bcast4(xq + (I8_PARTS * r + q) * kp + g);
                for (int v = 0; v < PANEL_VECS; v++) acc[r][v][q] = vi_dpbusd(acc[r][v][q], xb, wv[v]);
            }
    }
    float buf[NB];
    for (int r = 0; r < rows; r++) {
        float *out = cols == NB ? y + r * y_stride : buf;
        for (int v = 0; v < PANEL_VECS; v++)
            vf_store(out + v * LANES, i8_combine(acc[r][v], xs + I8_PARTS * r, w, col0 + v * LANES));
        if (cols != NB) memcpy(y + r * y_stride, buf, (size_t)cols * sizeof(float));
    }
}

static void i8_vnni_panel(const uint8_t *xq, int64_t k, const float *xs, const int8_t *panel, const lp_weight *w,
                          int64_t col0, float *y, int64_t y_stride, int64_t m, int64_t cols) {
    const int64_t k4 = (k + 3) & ~(int64_t)3, kp = I8_KP(k);
#define TILE(R)                                                                                                 \
    i8_vnni_tile(xq + I8_PARTS * r * kp, k4, kp, xs + I8_PARTS * r, panel, w, col0, y + r * y_stride, y_stride, R, \
                 cols)
    int64_t r = 0;
    for (; r + I8_ROWS <= m; r += I8_ROWS) TILE(I8_ROWS);
    switch (m - r) {
#if I8_ROWS > 5
        case 5: TILE(5); break;
        case 4: TILE(4); break;
        case 3: TILE(3); break;
#endif
#if I8_ROWS > 2
        case 2: TILE(2); break;
#endif
#if I8_ROWS > 1
        case 1: TILE(1); break;
#endif
        default: break;
    }
#undef TILE
}
#endif

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0-3: sums C[row block b][column tile c] at 2b + c (AMX_ROWS x 16 int32); 4, 5: the two row blocks' parts
 * (A: AMX_ROWS x 64 u8); 6, 7: two column tiles of the panel (B: 16 rows of 4 k x 16 columns). */
static void amx_load_config(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = t < 6 ? AMX_ROWS : 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* The rows of one C tile (row block starting at row r0 of x, 16 columns at c of the panel) combined into y. */
static void amx_store(const int32_t *sums, const float *xs, const lp_weight *w, int64_t col0, int64_t c, float *y,
                      int64_t y_stride, int64_t r0, int64_t m, int64_t cols) {
    if (c >= cols) return;
    const __mmask16 keep = cols - c >= 16 ? 0xffff : (__mmask16)((1u << (cols - c)) - 1);
    for (int64_t i = 0; i < AMX_REAL && r0 + i < m; i++) {
        vi acc[I8_PARTS];
        for (int q = 0; q < I8_PARTS; q++) acc[q] = vi_load(sums + (I8_PARTS * i + q) * 16);
        _mm512_mask_storeu_ps(y + (r0 + i) * y_stride + c, keep,
                              i8_combine(acc, xs + I8_PARTS * (r0 + i), w, col0 + c));
    }
}

/* All m rows x NB outputs of one int8 panel on the AMX tiles: two row blocks (2 * AMX_REAL rows of x) by two
 * column tiles a step, or the last row block alone by all four, over KP in 64-byte steps (the pad rows of the
 * scratch make every A tile whole). */
static void i8_amx_panel(const uint8_t *xq, int64_t k, const float *xs, const int8_t *panel, const lp_weight *w,
                         int64_t col0, float *y, int64_t y_stride, int64_t m, int64_t cols) {
    const int64_t kp = I8_KP(k), a_stride = kp, b_stride = NB * 4;
    int32_t sums[4][AMX_ROWS * 16] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < m; r0 += 2 * AMX_REAL) {
        const uint8_t *a0 = xq + r0 * I8_PARTS * kp, *a1 = a0 + AMX_ROWS * kp;
        if (m - r0 <= AMX_REAL) { /* one row block left: C tiles 0-3 are its four column tiles */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t g = 0; g < kp; g += 64) {
                _tile_loadd(4, a0 + g, a_stride);
                _tile_loadd(6, panel + g * NB, b_stride);
                _tile_loadd(7, panel + g * NB + 64, b_stride);
                _tile_dpbusd(0, 4, 6);
                _tile_dpbusd(1, 4, 7);
                _tile_loadd(6, panel + g * NB + 128, b_stride);
                _tile_loadd(7, panel + g * NB + 192, b_stride);
                _tile_dpbusd(2, 4, 6);
                _tile_dpbusd(3, 4, 7);
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
            for (int t = 0; t < 4; t++) amx_store(sums[t], xs, w, col0, 16 * t, y, y_stride, r0, m, cols);
            break;
        }
        for (int c = 0; c < NB && c < cols; c += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t g = 0; g < kp; g += 64) {
                _tile_loadd(4, a0 + g, a_stride);
                _tile_loadd(6, panel + g * NB + c * 4, b_stride);
                _tile_loadd(7, panel + g * NB + (c + 16) * 4, b_stride);
                _tile_dpbusd(0, 4, 6);
                _tile_dpbusd(1, 4, 7);
                _tile_loadd(5, a1 + g, a_stride);
                _tile_dpbusd(2, 5, 6);
                _tile_dpbusd(3, 5, 7);
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
            for (int t = 0; t < 4; t++)
                amx_store(sums[t], xs, w, col0, c + 16 * (t % 2), y, y_stride, r0 + AMX_REAL * (t / 2), m, cols);
        }
    }
}
#endif

#ifdef LANES
/* rows (<= TILE_ROWS) x NB outputs of one int8 panel, weights converted to fp32 (the path without VNNI). */
static inline __attribute__((always_inline)) void i8_cvt_tile(const float *x, int64_t x_stride, const int8_t *panel,
                                                               int64_t k, const lp_weight *w, int64_t col0, float *y,
                                                               int64_t y_stride, const int rows, int64_t cols) {
    vf acc[TILE_ROWS][PANEL_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < PANEL_VECS; v++) acc[r][v] = vf_zero();
#define STEP(G, J)                                                                                      \
    do {                                                                                                \
        vf wf[PANEL_VECS];                                                                              \
        for (int v = 0; v < PANEL_VECS; v++) wf[v] = VI_BYTE(vi_load(panel + (G) * NB + v * LANES * 4), J); \
        for (int r = 0; r < rows; r++) {                                                                \
            const vf xr = vf_bcast(x + r * x_stride + (G) + (J));                                       \
            for (int v = 0; v < PANEL_VECS; v++) acc[r][v] = vf_fma(xr, wf[v], acc[r][v]);              \
        }                                                                                               \
    } while (0)
    const int64_t full = k & ~(int64_t)3;
    for (int64_t g = 0; g < full; g += 4) {
        STEP(g, 0);
        STEP(g, 1);
        STEP(g, 2);
        STEP(g, 3);
    }
    if (k - full > 0) STEP(full, 0); /* the last k: x is not read past its row */
    if (k - full > 1) STEP(full, 1);
    if (k - full > 2) STEP(full, 2);
#undef STEP
    float buf[NB];
    for (int r = 0; r < rows; r++) {
        float *out = cols == NB ? y + r * y_stride : buf;
        for (int v = 0; v < PANEL_VECS; v++) {
            const vf o = vf_mul(acc[r][v], vf_load(w->scale + col0 + v * LANES));
            vf_store(out + v * LANES, w->bias ? vf_add(o, vf_load(w->bias + col0 + v * LANES)) : o);
        }
        if (cols != NB) memcpy(y + r * y_stride, buf, (size_t)cols * sizeof(float));
    }
}

static void i8_cvt_panel(const float *x, int64_t x_stride, const int8_t *panel, int64_t k, const lp_weight *w,
                         int64_t col0, float *y, int64_t y_stride, int64_t m, int64_t cols) {
#define TILE(R) i8_cvt_tile(x + r * x_stride, x_stride, panel, k, w, col0, y + r * y_stride, y_stride, R, cols)
    int64_t r = 0;
    for (; r + TILE_ROWS <= m; r += TILE_ROWS) TILE(TILE_ROWS);
    switch (m - r) {
#if TILE_ROWS > 5
        case 5: TILE(5); break;
        case 4: TILE(4); break;
        case 3: TILE(3); break;
#endif
        case 2: TILE(2); break;
        case 1: TILE(1); break;
        default: break;
    }
#undef TILE
}
#endif

/* y [M, N] (rows y_stride apart) = x [M, K] (rows x_stride apart) @ W.T + bias, W any lp_weight. With several
 * threads (lp_threads) the panels of a large weight (256K+ elements, or 4M+ products) are handed out one at a
 * time: a thread that loses its core to another process delays only the panel it holds, not a fixed share (the
 * barrier of a static split waits for the slowest). scratch: i8_scratch_bytes(m, k) bytes for the int8 paths'
 * quantized rows (NULL: allocated here). Returns 0, or -2 when memory ran out. */
static int gemm(const float *x, int64_t x_stride, const lp_weight *w, float *y, int64_t y_stride, int64_t m,
                int64_t n, int64_t k, void *scratch) {
    (void)scratch; /* unused without VNNI */
#ifdef LANES
    const int64_t num_panels = (n + NB - 1) / NB;
    const int kind = (int)w->kind, level = kind == LP_I8 ? lp_int8_isa() : I8_NONE;
    const int64_t panel_bytes = kind == LP_I8 ? I8_KP(k) * NB : k * NB * (kind == LP_F16 ? 2 : 4);
    uint8_t *xq = NULL;
    float *xs = NULL;
    void *own = NULL;
    const int amx = level >= I8_AMX && m >= AMX_MIN_ROWS;
#ifdef HAVE_VNNI
    if (level >= I8_VNNI) {
        if (!scratch) scratch = own = malloc((size_t)i8_scratch_bytes(m, k));
        if (!scratch) return -2;
        quantize_rows(x, x_stride, m, k, scratch, amx, &xq, &xs);
    }
#endif
    (void)xq, (void)xs, (void)amx;
#pragma omp parallel num_threads(lp_threads()) if (num_panels > 1 && (n * k >= (1 << 18) || m * n * k >= (1 << 22)))
    {
#ifdef HAVE_AMX
        if (amx) amx_load_config(); /* each thread's tiles */
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t cols = n - p * NB < NB ? n - p * NB : NB;
            const void *panel = (const char *)w->w + p * panel_bytes;
            float *yp = y + p * NB;
#ifdef HAVE_AMX
            if (amx) {
                i8_amx_panel(xq, k, xs, (const int8_t *)panel, w, p * NB, yp, y_stride, m, cols);
                continue;
            }
#endif
#ifdef HAVE_VNNI
            if (level >= I8_VNNI) {
                i8_vnni_panel(xq, k, xs, (const int8_t *)panel, w, p * NB, yp, y_stride, m, cols);
                continue;
            }
#endif
            if (kind == LP_I8)
                i8_cvt_panel(x, x_stride, (const int8_t *)panel, k, w, p * NB, yp, y_stride, m, cols);
            else
                (kind == LP_F16 ? gemm_panel_f16 : gemm_panel_f32)(x, x_stride, panel, k,
                                                                  w->bias ? w->bias + p * NB : NULL, yp, y_stride, m,
                                                                  cols);
        }
#ifdef HAVE_AMX
        if (amx) _tile_release();
#endif
    }
    free(own);
#else
    (void)x, (void)x_stride, (void)w, (void)y, (void)y_stride, (void)m, (void)n, (void)k, (void)scratch;
#endif
    return 0;
}

void lp_gemm_f16(const float *x, int64_t x_stride, const uint16_t *panels, const float *bias, float *y,
                 int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const lp_weight w = {panels, bias, NULL, NULL, LP_F16};
    gemm(x, x_stride, &w, y, y_stride, m, n, k, NULL);
}

void lp_gemm_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                 int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const lp_weight w = {panels, bias, NULL, NULL, LP_F32};
    gemm(x, x_stride, &w, y, y_stride, m, n, k, NULL);
}

/* The int8 GEMM (panels, scale, 128 * column sums and bias padded to the panels; K <= I8_MAX_K). Returns 0, or -2
 * when memory ran out. */
int lp_gemm_i8(const float *x, int64_t x_stride, const int8_t *panels, const float *scale, const int32_t *colsum,
               const float *bias, float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
    const lp_weight w = {panels, bias, scale, colsum, LP_I8};
    return gemm(x, x_stride, &w, y, y_stride, m, n, k, NULL);
}

int lp_int8_max_k(void) { return I8_MAX_K; }
int lp_int8_parts(void) { return I8_PARTS; }
int lp_int8_amx_min_rows(void) { return AMX_MIN_ROWS; }

int lp_max_head_dim(void) { return MAX_HEAD_DIM; }

/* ---- a repeated decode step's host arrays, from the last step's in place (step_arrays.RepeatedDecode) ---- */

/* positions += 1, context_lens = positions + 1, slot_mapping = the row's block (block_tables [rows, width]) for
 * its position * block_size + the offset in it. Returns -1 (nothing past that row written) when a position's
 * block is past its row's width. */
int lp_advance_decode(int64_t *positions, int64_t *slot_mapping, int32_t *context_lens, const int32_t *block_tables,
                      int64_t rows, int64_t width, int64_t block_size) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = positions[r] + 1, block = p / block_size;
        if (p < 0 || block >= width) return -1;
        positions[r] = p;
        context_lens[r] = (int32_t)(p + 1);
        slot_mapping[r] = (int64_t)block_tables[r * width + block] * block_size + p % block_size;
    }
    return 0;
}

/* ---- greedy sampling: each row's argmax, and whether every logit is finite, in one pass over the logits ---- */

/* The first index of value m in v[0..n) (m is there). */
static int64_t first_index_of(const float *v, int64_t n, float m) {
    int64_t i = 0;
#ifdef LANES
    const vf target = vf_set(m);
    for (; i + LANES <= n; i += LANES) {
        const unsigned hits = vf_eq_mask(vf_load(v + i), target);
        if (hits) return i + __builtin_ctz(hits);
    }
#endif
    while (v[i] != m) i++;
    return i;
}

/* out[r] = the index of row r's largest value: the first of ties, and the first NaN where a row has one (as
 * numpy's argmax). Returns the number of rows holding a NaN or an infinity. */
int64_t lp_argmax_rows(const float *x, int64_t stride, int64_t rows, int64_t n, int64_t *out) {
    int64_t bad = 0;
#pragma omp parallel for num_threads(lp_threads()) reduction(+ : bad) if (rows * n >= (1 << 20))
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * stride;
        float m = -INFINITY, z = 0.f; /* z: the sum of v[i] * 0, NaN exactly when a value is not finite */
#pragma omp simd reduction(max : m) reduction(+ : z)
        for (int64_t i = 0; i < n; i++) {
            m = v[i] > m ? v[i] : m; /* vmaxps (fmaxf: a libm call); a NaN is skipped, z flags it */
            z += v[i] * 0.f;
        }
        if (z != z) {
            bad++;
            int64_t at = 0;
            while (at < n && v[at] == v[at]) at++;
            if (at < n) {
                out[r] = at;
                continue;
            }
        }
        out[r] = n > 0 ? first_index_of(v, n, m) : 0;
    }
    return bad;
}

/* ---- LoRA deltas of a decode step (BGMV): y[t] += scale * (x[t] @ A.T) @ B.T of each row's adapter slot ----
 * The rows are grouped by slot and cut into items of up to TILE_ROWS rows: an item reads its adapter's A and
 * B.T once for all its rows (the rows' shrink sums and expand outputs stay in registers), and the items of a
 * projection, or of the projections that read one input (q/k/v, gate/up), go out to the threads one by one.
 * The stacks are fp32, or fp16 (half: read as fp32 by F16C, half the bytes of these memory-bound loops). */

typedef struct { /* one projection's slot stacks: A [S, R, in], B.T [S, R, out] (contiguous); ranks, scales [S] */
    const void *a, *bt;
    const int32_t *ranks;
    const float *scales;
} lp_lora_module;

typedef struct { /* the step's rows on adapters: items of up to TILE_ROWS rows of one slot */
    int64_t items;
    const int64_t *first;  /* [items + 1]: item i is rows order[first[i] .. first[i + 1]) */
    const int64_t *order;  /* the rows, grouped by slot */
    const int32_t *slot;   /* [items] */
} lp_lora_plan;

#ifndef TILE_ROWS
#define TILE_ROWS 1
#endif

/* Element i of a stack of fp16 (half) or fp32 values, as fp32. */
static inline float stack_at(const void *p, int64_t i, const int half) {
#ifdef LANES
    if (half) return _cvtsh_ss(((const uint16_t *)p)[i]);
#endif
    (void)half;
    return ((const float *)p)[i];
}

/* v[r][j] = scale * x[row r] . A[j] for j < rank, four rows of A at a time: the n rows (a constant after
 * inlining, so the sums stay in registers) share each load of A, and each (row, j) has its own chain. */
static inline __attribute__((always_inline)) void lora_shrink_tile(const float *x, int64_t x_stride,
                                                                    const int64_t *rows, const int n, const void *a,
                                                                    int64_t rank, int64_t in, float scale, float *v,
                                                                    const int half) {
    const float *xr[TILE_ROWS];
    for (int r = 0; r < n; r++) xr[r] = x + rows[r] * x_stride;
    int64_t j = 0;
#ifdef LANES
    if (in % LANES == 0)
        for (; j + 4 <= rank; j += 4) {
            vf acc[TILE_ROWS][4];
            for (int r = 0; r < n; r++)
                for (int q = 0; q < 4; q++) acc[r][q] = vf_zero();
            for (int64_t i = 0; i < in; i += LANES) {
                vf w[4];
                for (int q = 0; q < 4; q++) w[q] = load_weights(a, (j + q) * in + i, half);
                for (int r = 0; r < n; r++) {
                    const vf xv = vf_load(xr[r] + i);
                    for (int q = 0; q < 4; q++) acc[r][q] = vf_fma(xv, w[q], acc[r][q]);
                }
            }
            for (int r = 0; r < n; r++)
                for (int q = 0; q < 4; q++) v[r * rank + j + q] = vf_sum(acc[r][q]) * scale;
        }
#endif
    for (; j < rank; j++) /* the last ranks (or every rank, when in is not whole vectors) */
        for (int r = 0; r < n; r++) {
            float sum = 0.f;
            for (int64_t i = 0; i < in; i++) sum = fmaf(xr[r][i], stack_at(a, j * in + i, half), sum);
            v[r * rank + j] = sum * scale;
        }
}

/* y[row r] += v[r] @ B.T[:rank], 4 vectors of columns at a time: the n rows share each load of B.T. */
static inline __attribute__((always_inline)) void lora_expand_tile(float *y, int64_t y_stride, const int64_t *rows,
                                                                    const int n, const void *bt, int64_t rank,
                                                                    int64_t out, const float *v, const int half) {
    float *yr[TILE_ROWS];
    for (int r = 0; r < n; r++) yr[r] = y + rows[r] * y_stride;
    int64_t c = 0;
#ifdef LANES
    for (; c + 4 * LANES <= out; c += 4 * LANES) {
        vf acc[TILE_ROWS][4];
        for (int r = 0; r < n; r++)
            for (int q = 0; q < 4; q++) acc[r][q] = vf_zero();
        for (int64_t j = 0; j < rank; j++) {
            vf w[4];
            for (int q = 0; q < 4; q++) w[q] = load_weights(bt, j * out + c + q * LANES, half);
            for (int r = 0; r < n; r++) {
                const vf vr = vf_bcast(v + r * rank + j);
                for (int q = 0; q < 4; q++) acc[r][q] = vf_fma(vr, w[q], acc[r][q]);
            }
        }
        for (int r = 0; r < n; r++)
            for (int q = 0; q < 4; q++)
                vf_store(yr[r] + c + q * LANES, vf_add(vf_load(yr[r] + c + q * LANES), acc[r][q]));
    }
    for (; c + LANES <= out; c += LANES) {
        vf acc[TILE_ROWS];
        for (int r = 0; r < n; r++) acc[r] = vf_zero();
        for (int64_t j = 0; j < rank; j++) {
            const vf w = load_weights(bt, j * out + c, half);
            for (int r = 0; r < n; r++) acc[r] = vf_fma(vf_bcast(v + r * rank + j), w, acc[r]);
        }
        for (int r = 0; r < n; r++) vf_store(yr[r] + c, vf_add(vf_load(yr[r] + c), acc[r]));
    }
#endif
    for (; c < out; c++)
        for (int r = 0; r < n; r++) {
            float sum = 0.f;
            for (int64_t j = 0; j < rank; j++) sum = fmaf(v[r * rank + j], stack_at(bt, j * out + c, half), sum);
            yr[r][c] += sum;
        }
}

/* One item's delta: n rows of one slot, n and half constants in each case. */
static inline __attribute__((always_inline)) void lora_tile(const float *x, int64_t x_stride, float *y,
                                                             int64_t y_stride, const int64_t *rows, int n,
                                                             const void *a, const void *bt, int64_t rank, int64_t in,
                                                             int64_t out, float scale, const int half) {
    float v[TILE_ROWS * rank];
#define LORA_TILE(N)                                                         \
    lora_shrink_tile(x, x_stride, rows, N, a, rank, in, scale, v, half);     \
    lora_expand_tile(y, y_stride, rows, N, bt, rank, out, v, half);          \
    break
    switch (n) {
#if TILE_ROWS > 5
        case 6: LORA_TILE(6);
        case 5: LORA_TILE(5);
        case 4: LORA_TILE(4);
#endif
#if TILE_ROWS > 2
        case 3: LORA_TILE(3);
#endif
#if TILE_ROWS > 1
        case 2: LORA_TILE(2);
#endif
        default: LORA_TILE(1);
    }
#undef LORA_TILE
}

static void lora_tile_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, const int64_t *rows, int n,
                          const void *a, const void *bt, int64_t rank, int64_t in, int64_t out, float scale) {
    lora_tile(x, x_stride, y, y_stride, rows, n, a, bt, rank, in, out, scale, 0);
}

static void lora_tile_f16(const float *x, int64_t x_stride, float *y, int64_t y_stride, const int64_t *rows, int n,
                          const void *a, const void *bt, int64_t rank, int64_t in, int64_t out, float scale) {
    lora_tile(x, x_stride, y, y_stride, rows, n, a, bt, rank, in, out, scale, 1);
}

/* Each plan item's delta for modules m[0..count) into their outputs y[k] (rows y_stride apart), all reading x. */
static void lora_add(const float *x, int64_t x_stride, float *const *y, int64_t y_stride, const lp_lora_module *m,
                     const int64_t *in, const int64_t *out, int count, const lp_lora_plan *plan, int64_t max_rank,
                     int half) {
    const int64_t work = plan->items * count, esize = half ? 2 : 4;
#pragma omp parallel for num_threads(lp_threads()) schedule(dynamic, 1) if (work > 1)
    for (int64_t w = 0; w < work; w++) {
        const int64_t item = w / count, k = w % count, s = plan->slot[item];
        const int64_t rank = m[k].ranks[s];
        if (rank <= 0) continue; /* the adapter does not adapt this projection */
        const int64_t *rows = plan->order + plan->first[item];
        const int n = (int)(plan->first[item + 1] - plan->first[item]);
        const char *a = (const char *)m[k].a + s * max_rank * in[k] * esize;
        const char *bt = (const char *)m[k].bt + s * max_rank * out[k] * esize;
        (half ? lora_tile_f16 : lora_tile_f32)(x, x_stride, y[k], y_stride, rows, n, a, bt, rank, in[k], out[k],
                                               m[k].scales[s]);
    }
}

/* The plan of rows 0..rows-1 on slots (-1: none; else < num_slots), its arrays in one allocation (plan->first;
 * the caller frees it). Returns 0, -1 for a slot out of range, -2 when memory ran out (nothing to free then). */
static int lora_plan(const int32_t *slots, int64_t rows, int64_t num_slots, lp_lora_plan *plan) {
    *plan = (lp_lora_plan){0, NULL, NULL, NULL};
    int64_t *count = (int64_t *)calloc((size_t)num_slots + 1, sizeof(int64_t));
    int64_t *mem = (int64_t *)malloc((size_t)(2 * rows + 1) * sizeof(int64_t) + (size_t)(rows + 1) * sizeof(int32_t));
    int rc = !count || !mem ? -2 : 0;
    for (int64_t t = 0; t < rows && !rc; t++) {
        if (slots[t] >= num_slots) rc = -1;
        else if (slots[t] >= 0) count[slots[t] + 1]++;
    }
    if (rc) {
        free(count);
        free(mem);
        return rc;
    }
    int64_t *first = mem, *order = mem + rows + 1;
    int32_t *slot = (int32_t *)(mem + 2 * rows + 1);
    for (int64_t s = 0; s < num_slots; s++) count[s + 1] += count[s]; /* count[s]: where slot s's rows start */
    int64_t items = 0, total = count[num_slots];
    for (int64_t s = 0; s < num_slots; s++)
        for (int64_t at = count[s]; at < count[s + 1]; at += TILE_ROWS) {
            first[items] = at;
            slot[items++] = (int32_t)s;
        }
    first[items] = total;
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] >= 0) order[count[slots[t]]++] = t;
    free(count);
    *plan = (lp_lora_plan){items, first, order, slot};
    return 0;
}

/* One projection's LoRA deltas for rows on token_slots: y [rows, out] += per row, as above (stacks in fp16 if
 * half). For tests. Returns 0, -1 for a slot >= num_slots, -2 when memory ran out. */
int lp_lora_add(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t rows, const int32_t *token_slots,
                const void *a, const void *bt, const int32_t *ranks, const float *scales, int64_t num_slots,
                int64_t max_rank, int64_t in, int64_t out, int64_t half) {
    lp_lora_plan plan;
    const int rc = lora_plan(token_slots, rows, num_slots, &plan);
    if (!rc && plan.items) {
        const lp_lora_module m = {a, bt, ranks, scales};
        lora_add(x, x_stride, &y, y_stride, &m, &in, &out, 1, &plan, max_rank, half != 0);
    }
    free((void *)plan.first);
    return rc;
}


/* ---- a whole decode forward of the base model in one call: the ops above, in the model's order ---- */

typedef struct { /* one layer's weights: norms and projections (each its own kind: fp32, fp16 or int8 panels); its
                  * attention's sliding window (0: none) and score soft-cap (0: none), as lp_paged_decode takes them */
    const float *input_norm, *post_norm;
    lp_weight qkv, o, gate_up, down;
    int64_t window;
    float softcap;
} lp_layer;

typedef struct { /* the model's shapes */
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
} lp_shapes;

typedef struct { /* the step: rows tokens, one per sequence, and where their K/V go and come from */
    int64_t rows;
    const int64_t *positions, *slot_mapping;
    const int32_t *block_tables, *context_lens;
    int64_t table_stride, max_blocks;
    const float *cos, *signed_sin;
    int64_t table_rows;
    float *kv_cache; /* [layers, 2, num_blocks, block_size, kv_heads, head_dim] */
    int64_t num_blocks, block_size;
    const int32_t *token_slots; /* each row's adapter slot (-1: none), or NULL: no adapters this step */
    int64_t num_slots, max_rank, lora_half; /* lora_half: the stacks hold fp16 */
} lp_step;

/* h [rows, hidden] (the embeddings; updated in place as the residual stream) -> out [rows, hidden] after the
 * final norm, exactly as LlamaModel.forward computes it op by op with these ops (the same values). With
 * s->token_slots, lora holds each layer's 7 projections' stacks (MODULES' order) and every projection's
 * output gets its rows' LoRA deltas before it is read.
 * Returns 0, -1 for a position, slot, block or adapter slot outside its table, -2 when memory ran out. */
int lp_decode_forward(const lp_shapes *m, const lp_layer *layers, const float *final_norm, const lp_step *s,
                      const lp_lora_module *lora, float *h, float *out) {
    const int64_t rows = s->rows, hid = m->hidden, d = m->head_dim, qd = m->heads * d, kvd = m->kv_heads * d;
    const int64_t wqkv = qd + 2 * kvd, inter = m->intermediate;
    const int64_t layer_elems = s->num_blocks * s->block_size * kvd;
    const int64_t widest = hid > qd ? (hid > inter ? hid : inter) : (qd > inter ? qd : inter);
    float *buf = (float *)malloc((size_t)(rows * (2 * hid + wqkv + qd + 3 * inter)) * sizeof(float));
    void *scratch = malloc((size_t)i8_scratch_bytes(rows, widest)); /* the int8 GEMMs' quantized rows */
    if (!buf || !scratch) {
        free(buf);
        free(scratch);
        return -2;
    }
    float *x = buf, *qkv = x + rows * hid, *att = qkv + rows * wqkv, *proj = att + rows * qd;
    float *gu = proj + rows * hid, *act = gu + rows * 2 * inter;
    const float *delta = NULL;
    int rc = 0;
    lp_lora_plan plan = {0, NULL, NULL, NULL};
    if (s->token_slots) rc = lora_plan(s->token_slots, rows, s->num_slots, &plan);
    const int adapted = plan.items > 0, lora_half = s->lora_half != 0;
    const int64_t qkv_in[3] = {hid, hid, hid}, qkv_out[3] = {qd, kvd, kvd}, gu_in[2] = {hid, hid};
    const int64_t gu_out[2] = {inter, inter};
    float *qkv_y[3] = {qkv, qkv + qd, qkv + qd + kvd}, *gu_y[2] = {gu, gu + inter};
    for (int64_t i = 0; i < m->num_layers && !rc; i++) {
        const lp_layer *w = layers + i;
        float *k_cache = s->kv_cache + 2 * i * layer_elems, *v_cache = k_cache + layer_elems;
        lp_add_rms_norm(h, hid, delta, hid, w->input_norm, x, hid, rows, hid, m->eps);
        const lp_lora_module *ad = adapted ? lora + 7 * i : NULL; /* q, k, v, o, gate, up, down */
        gemm(x, hid, &w->qkv, qkv, wqkv, rows, wqkv, hid, scratch);
        if (ad) lora_add(x, hid, qkv_y, wqkv, ad, qkv_in, qkv_out, 3, &plan, s->max_rank, lora_half);
        rc = lp_rotate_qk(qkv, wqkv, m->heads, qkv + qd, wqkv, m->kv_heads, d, s->positions, rows, s->cos,
                          s->signed_sin, s->table_rows);
        if (!rc)
            rc = lp_write_kv(k_cache, v_cache, qkv + qd, wqkv, qkv + qd + kvd, wqkv, s->slot_mapping, rows, kvd,
                             s->num_blocks * s->block_size);
        if (!rc)
            rc = lp_paged_decode(qkv, wqkv, att, k_cache, v_cache, s->block_tables, s->table_stride, s->max_blocks,
                                 s->context_lens, rows, m->heads, m->kv_heads, d, s->block_size, s->num_blocks,
                                 m->scale, w->window, w->softcap);
        if (rc) break;
        gemm(att, qd, &w->o, proj, hid, rows, hid, qd, scratch);
        if (ad) lora_add(att, qd, &proj, hid, ad + 3, &qd, &hid, 1, &plan, s->max_rank, lora_half);
        lp_add_rms_norm(h, hid, proj, hid, w->post_norm, x, hid, rows, hid, m->eps);
        gemm(x, hid, &w->gate_up, gu, 2 * inter, rows, 2 * inter, hid, scratch);
        if (ad) lora_add(x, hid, gu_y, 2 * inter, ad + 4, gu_in, gu_out, 2, &plan, s->max_rank, lora_half);
        lp_silu_mul(gu, 2 * inter, gu + inter, 2 * inter, act, inter, rows, inter);
        gemm(act, inter, &w->down, proj, hid, rows, hid, inter, scratch);
        if (ad) lora_add(act, inter, &proj, hid, ad + 6, &inter, &hid, 1, &plan, s->max_rank, lora_half);
        delta = proj;
    }
    if (!rc) lp_add_rms_norm(h, hid, delta, hid, final_norm, out, hid, rows, hid, m->eps);
    free(buf);
    free(scratch);
    free((void *)plan.first);
    return rc;
}
