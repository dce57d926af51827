/* The prefill GEMM on AMX-BF16 tiles, over the native GEMM's own fp32 or fp16 panels (amx_bf16.py; decision 074):
 *
 *   y [M, N] = x [M, K] @ W.T + bias, with x and W each split into P bf16 parts (v1 = bf16(v), v2 = bf16(v - v1))
 *   and the products of parts i + j < P summed in fp32 tiles. A bf16 x bf16 product is exact in fp32 and
 *   tdpbf16ps sums in fp32, so P = 2 (three products) carries x and W to 16 significant bits (an fp16 weight
 *   whole); P = 1 is plain bf16 (one product), its output still fp32.
 *
 * W is read from the panels cpu_native packs ([N / NB, K, NB], fp32 or fp16; bias padded to them): each pair of
 * 16-column blocks is split into bf16 tiles per chunk of rows, so no second copy of the weights is kept.
 *
 * Built by amx_bf16.py with cc -O3 -march=native -fopenmp; where the compiler has no AMX-BF16 for this CPU only
 * stubs are built (lp_bf16_amx() returns 0). Linux grants a process the tile state on request (arch_prctl, once).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define MAX_PARTS 2

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define BLOCK 16                   /* rows or columns of a tile */
#define KSTEP 32                   /* k of a tile row (bf16) */
#define TILE_ELEMS (BLOCK * KSTEP) /* bf16 in a tile */
#define M_CHUNK 256                /* rows of x a task multiplies */

static int amx_state = -1; /* -1: not asked yet; 0: refused; 1: granted */

int lp_bf16_amx(void) {
    if (amx_state < 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-3: sums C[row block r][column block c] at 2r + c (16 x 16 fp32); 4, 5: A of the two row blocks (16 rows
 * x 32 k, one part); 6, 7: B of the two column blocks (16 k pairs x 16 columns x 2, one part). */
static void load_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = BLOCK, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

static inline __m512 widen(__m256bh h) { /* bf16 -> fp32, exact */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

/* 16 fp32 -> parts bf16 (the rounded value, then the rounded rest). */
static inline void split16(__m512 v, int parts, __m256bh out[MAX_PARTS]) {
    for (int p = 0; p < parts; p++) {
        out[p] = _mm512_cvtneps_pbh(v);
        v = _mm512_sub_ps(v, widen(out[p]));
    }
}

/* x rows [r0, r0 + rows) -> xp[p][row][kp] bf16 parts, rows up to rows_padded and k up to kp zero; inside a parallel
 * region, its rows handed out in runs (the loop ends in a barrier). */
static void split_rows(const float *x, int64_t x_stride, int64_t r0, int64_t rows, int64_t rows_padded, int64_t k,
                       int64_t kp, int parts, uint16_t *xp) {
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < rows_padded; r++) {
        for (int64_t i = 0; i < kp; i += 16) {
            const int64_t left = r < rows ? k - i : 0;
            const __mmask16 mask = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            __m256bh h[MAX_PARTS];
            split16(_mm512_maskz_loadu_ps(mask, x + (r0 + r) * x_stride + i), parts, h);
            for (int p = 0; p < parts; p++) _mm256_storeu_si256((__m256i *)(xp + (p * rows_padded + r) * kp + i), (__m256i)h[p]);
        }
    }
}

/* 16 weights of one k and 16 columns (col0..col0 + 15 of W) from a panel row: fp32 or fp16. */
static inline __m512 panel_row(const void *panels, int half, int64_t nb, int64_t k, int64_t kk, int64_t col0) {
    const int64_t at = (col0 / nb) * k * nb + kk * nb + col0 % nb;
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)panels + at)))
                : _mm512_loadu_ps((const float *)panels + at);
}

/* Columns [col0, col0 + 32) of W (their panels) -> bp[c][p][s] B tiles (c: the two column blocks; s: k steps; k
 * past K zero): tile row j holds, for each of 16 columns, k = 32 s + 2 j and 32 s + 2 j + 1 side by side. */
static void split_columns(const void *panels, int half, int64_t nb, int64_t k, int64_t kb, int64_t col0, int parts,
                          uint16_t *bp) {
    const __m512i pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int c = 0; c < 2; c++)
        for (int64_t s = 0; s < kb; s++)
            for (int j = 0; j < BLOCK; j++) {
                const int64_t k0 = s * KSTEP + 2 * j;
                __m256bh even[MAX_PARTS], odd[MAX_PARTS];
                const __m512 zero = _mm512_setzero_ps();
                split16(k0 < k ? panel_row(panels, half, nb, k, k0, col0 + c * BLOCK) : zero, parts, even);
                split16(k0 + 1 < k ? panel_row(panels, half, nb, k, k0 + 1, col0 + c * BLOCK) : zero, parts, odd);
                for (int p = 0; p < parts; p++) {
                    const __m512i row = _mm512_permutex2var_epi16(_mm512_castsi256_si512((__m256i)even[p]), pairs,
                                                                  _mm512_castsi256_si512((__m256i)odd[p]));
                    _mm512_storeu_si512(bp + ((c * parts + p) * kb + s) * TILE_ELEMS + j * 2 * BLOCK, row);
                }
            }
}

/* C tiles of the block at rows row0.., columns col0.. (32 x 32) into y, bias (padded) added; past m or n not
 * stored. */
static void store_block(float *y, int64_t y_stride, int64_t row0, int64_t col0, int64_t m, int64_t n,
                        const float *bias) {
    float sums[4][BLOCK * BLOCK] __attribute__((aligned(64)));
    const int whole = row0 + 2 * BLOCK <= m && col0 + 2 * BLOCK <= n;
    float *out = y + row0 * y_stride + col0;
    if (whole) { /* the tiles straight into y */
        _tile_stored(0, out, y_stride * 4);
        _tile_stored(1, out + BLOCK, y_stride * 4);
        _tile_stored(2, out + BLOCK * y_stride, y_stride * 4);
        _tile_stored(3, out + BLOCK * y_stride + BLOCK, y_stride * 4);
        if (bias)
            for (int64_t r = 0; r < 2 * BLOCK; r++)
                for (int64_t c = 0; c < 2 * BLOCK; c++) out[r * y_stride + c] += bias[col0 + c];
        return;
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    for (int t = 0; t < 4; t++) {
        const int64_t r0 = row0 + (t / 2) * BLOCK, c0 = col0 + (t % 2) * BLOCK;
        for (int64_t r = 0; r < BLOCK && r0 + r < m; r++)
            for (int64_t c = 0; c < BLOCK && c0 + c < n; c++)
                y[(r0 + r) * y_stride + c0 + c] = sums[t][r * BLOCK + c] + (bias ? bias[c0 + c] : 0.0f);
    }
}

/* y = x @ W.T + bias, W the panels (half: fp16, else fp32; nb columns a panel, a multiple of 32), both split into
 * parts (1 or 2); threads: the parallel loops' count (pairs of column blocks handed out one at a time). Returns 0,
 * or -1 where it cannot run (tiles not granted, parts or nb out of range, no memory). */
int lp_bf16_gemm(const float *x, int64_t x_stride, const void *panels, int half, int64_t nb, const float *bias,
                 float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k, int parts, int threads) {
    if (!lp_bf16_amx() || parts < 1 || parts > MAX_PARTS || nb <= 0 || nb % (2 * BLOCK)) return -1;
    const int64_t kp = (k + KSTEP - 1) / KSTEP * KSTEP, kb = kp / KSTEP, col_pairs = (n + 2 * BLOCK - 1) / (2 * BLOCK);
    int pi[MAX_PARTS * MAX_PARTS], pj[MAX_PARTS * MAX_PARTS], np = 0;
    for (int i = 0; i < parts; i++) /* by x part, so each A tile is loaded once a step */
        for (int j = 0; i + j < parts; j++) pi[np] = i, pj[np] = j, np++;
    const int nthreads = threads > 0 ? threads : omp_get_max_threads();
    const int64_t rows_padded = (m + 2 * BLOCK - 1) / (2 * BLOCK) * (2 * BLOCK);
    const int64_t chunks = (rows_padded + M_CHUNK - 1) / M_CHUNK, tasks = chunks * col_pairs;
    const size_t b_elems = (size_t)2 * parts * kb * TILE_ELEMS;
    uint16_t *xp = aligned_alloc(64, (size_t)parts * rows_padded * kp * sizeof(uint16_t));
    uint16_t *bp = aligned_alloc(64, b_elems * nthreads * sizeof(uint16_t));
    if (!xp || !bp) {
        free(xp), free(bp);
        return -1;
    }
    /* one parallel region: the rows split (a barrier), then (column pair, row chunk) tasks handed out one at a time,
     * so a thread that loses its core delays only the task it holds; a thread's next task is mostly of the same
     * column pair, whose B tiles it keeps */
#pragma omp parallel num_threads(nthreads)
    {
        split_rows(x, x_stride, 0, m, rows_padded, k, kp, parts, xp);
        load_config();
        uint16_t *mine = bp + b_elems * omp_get_thread_num();
        int64_t split_cp = -1; /* the column pair whose B tiles mine holds */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t cp = t / chunks, r_end = (t % chunks + 1) * M_CHUNK, col0 = cp * 2 * BLOCK;
            if (cp != split_cp) split_columns(panels, half, nb, k, kb, col0, parts, mine), split_cp = cp;
            for (int64_t rb = (t % chunks) * M_CHUNK; rb < r_end && rb < rows_padded; rb += 2 * BLOCK) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t s = 0; s < kb; s++)
                    for (int q = 0; q < np; q++) {
                        if (q == 0 || pi[q] != pi[q - 1]) { /* the pairs go by x part: one A load each */
                            const uint16_t *a = xp + (pi[q] * rows_padded + rb) * kp + s * KSTEP;
                            _tile_loadd(4, a, kp * 2);
                            _tile_loadd(5, a + BLOCK * kp, kp * 2);
                        }
                        _tile_loadd(6, mine + ((0 * parts + pj[q]) * kb + s) * TILE_ELEMS, 64);
                        _tile_loadd(7, mine + ((1 * parts + pj[q]) * kb + s) * TILE_ELEMS, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                store_block(y, y_stride, rb, col0, m, n, bias);
            }
        }
        _tile_release();
    }
    free(xp);
    free(bp);
    return 0;
}
#else
int lp_bf16_amx(void) { return 0; }

int lp_bf16_gemm(const float *x, int64_t x_stride, const void *panels, int half, int64_t nb, const float *bias,
                 float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k, int parts, int threads) {
    (void)x, (void)x_stride, (void)panels, (void)half, (void)nb, (void)bias, (void)y, (void)y_stride, (void)m,
        (void)n, (void)k, (void)parts, (void)threads;
    return -1;
}
#endif
