/* Native CPU ops of the decode step (fp32): one call where torch takes several small ops.
 *
 * Built by cpu_native.py with gcc -O3 -march=native -ffp-contract=off -fopenmp-simd (no FMA
 * contraction: the elementwise ops round like torch's), loaded with ctypes. Rows may be
 * strided (views of a fused projection's output); the last dimension is contiguous.
 * Single-threaded except the decode attention, which shares torch's OpenMP pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* exp(x) for x <= 0 in float (Cephes' expf polynomial, about 1 ulp), branch-free so that loops vectorize. */
static inline float lp_exp(float x) {
    x = x < -87.33654f ? -87.33654f : x;
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
    union { int32_t i; float f; } scale = {.i = ((int32_t)k + 127) << 23};
    return p * scale.f;
}

/* out[r] = silu(gate[r]) * up[r]: silu(g) = g / (1 + exp(-g)), exp taken of -|g| to stay in range. */
void lp_silu_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, float *out,
                 int64_t out_stride, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float e = lp_exp(-fabsf(g[i]));  /* exp(-|g|) in (0, 1] */
            const float sig = g[i] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
            o[i] = g[i] * sig * u[i];
        }
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
                 const int64_t *positions, int64_t rows, const float *cos, const float *signed_sin, int64_t table_rows) {
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

/* One sequence's query heads [group, D] of KV head g over its n cached positions -> out [group, D].
 * scores holds group * n floats. Exact softmax: scores, their max, exp, then the weighted sum of V. */
static void attend_group(const float *q, int64_t q_head_stride, float *out, int64_t group, const float *k_cache,
                         const float *v_cache, const int32_t *blocks, int64_t n, int64_t block_size,
                         int64_t hkv, int64_t g, int64_t d, float scale, float *scores) {
    const int64_t row = hkv * d;
    for (int64_t p = 0; p < n; p++) {
        const float *kp = k_cache + ((int64_t)blocks[p / block_size] * block_size + p % block_size) * row + g * d;
        for (int64_t j = 0; j < group; j++) {
            const float *qj = q + j * q_head_stride;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; i++) dot += qj[i] * kp[i];
            scores[j * n + p] = dot * scale;
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float *s = scores + j * n, m = -INFINITY, sum = 0.f;
        for (int64_t p = 0; p < n; p++) m = s[p] > m ? s[p] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < n; p++) {
            s[p] = lp_exp(s[p] - m);
            sum += s[p];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t p = 0; p < n; p++) s[p] *= inv;
        memset(out + j * d, 0, (size_t)d * sizeof(float));
    }
    for (int64_t p = 0; p < n; p++) {
        const float *vp = v_cache + ((int64_t)blocks[p / block_size] * block_size + p % block_size) * row + g * d;
        for (int64_t j = 0; j < group; j++) {
            const float w = scores[j * n + p];
            float *o = out + j * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) o[i] += w * vp[i];
        }
    }
}

/* Paged decode attention: q [B, Hq, D] (rows q_stride apart, heads contiguous), one query per sequence over its context_lens[b]
 * cached positions, found through block_tables [B, max_blocks] -> out [B, Hq, D]; an empty context
 * gives zeros. Work items are (sequence, KV head), spread over torch's OpenMP threads when there are several.
 * Returns 0; -1 (nothing computed) when a context passes its block table or a block the cache's num_blocks;
 * -2 when scratch memory could not be allocated. */
int lp_paged_decode(const float *q, int64_t q_stride, float *out, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                    int64_t max_blocks, const int32_t *context_lens, int64_t num_seqs, int64_t hq, int64_t hkv,
                    int64_t d, int64_t block_size, int64_t num_blocks, float scale) {
    const int64_t group = hq / hkv, items = num_seqs * hkv;
    int64_t longest = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t n = context_lens[b], used = (n + block_size - 1) / block_size;
        if (used > max_blocks) return -1;
        for (int64_t i = 0; i < used; i++)
            if (block_tables[b * max_blocks + i] < 0 || block_tables[b * max_blocks + i] >= num_blocks) return -1;
        longest = n > longest ? n : longest;
    }
    int failed = 0;
#pragma omp parallel if (items > 1 && longest * items >= 4096)
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
            attend_group(q + b * q_stride + g * group * d, d, o, group, k_cache, v_cache, block_tables + b * max_blocks, n,
                         block_size, hkv, g, d, scale, scores);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

int lp_max_head_dim(void) { return MAX_HEAD_DIM; }
