/* What the panel GEMMs share (f32_panel.c's fp32 weights, bf16_panel.c's bf16 ones): the
 * tiling constants, the prefetch pacing, where a tile's sums go, a product's description, and
 * the walk of a panel's rows in register tiles. panel_gemm.c hands the (panel, row) pairs out
 * to the threads; each element type supplies the sums of some rows over one panel. A panel is
 * 64 output channels; a "panel row" is 256 bytes: one k of 64 fp32 weights, or one k-pair of
 * 64 bf16 pairs. */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

#define TM_MAX_ROWS 32 /* rows per pass: their x chunk and the panel chunk share L1 */

/* A tile prefetches its share of the next chunk, 64-byte lines [lo, hi), spread evenly over
 * its n k-steps (16.16 fixed point, so no division in the loop). Every tile of a chunk takes
 * an equal share: the weight streams at an even rate while the tiles compute. When the first
 * tile fetched the whole next chunk in a burst, small row counts waited on memory (the
 * default model's 120 projections streaming, AVX-512: 12-24 rows 1.15-1.24x faster spread,
 * 48-2048 rows the same; bench/NOTES.md). */
#define FETCH_PLAN(lo, hi, n) \
    const int64_t fetch_step = ((hi) - (lo)) * 65536 / (n); \
    int64_t fetch_due = (lo) * 65536
#define FETCH_DUE(fetch, lo, hint) \
    for (fetch_due += fetch_step; (lo) < fetch_due >> 16; (lo)++) \
        _mm_prefetch((const char *)(fetch) + (lo) * 64, hint)

#ifdef __AVX512F__
#define TM_STRIP 64 /* columns a tile covers: the whole panel in 4 zmm sums a row */
/* Panel rows per k-chunk for a product of M rows: 128 (32 KB) where many rows reuse the chunk,
 * so each tile reloads its sums half as often as with 64 (2-10 % faster from 64 to 2048 rows
 * on a Zen 4); 64 (16 KB) from 32 rows down, where a chunk's tiles finish sooner than its
 * successor arrives from memory: 12-32 rows 1.04-1.08x (interleaved A/B, bench/NOTES.md). */
#define TM_KC(M) ((M) <= 32 ? 64 : 128)
#define TM_FETCH_HINT _MM_HINT_T1
#else
#define TM_STRIP 16 /* AVX2: 2 ymm sums a row */
#define TM_KC(M) 64 /* panel rows per k-chunk (16 KB): the 4 strips' tiles share it in L1 */
#define TM_FETCH_HINT _MM_HINT_T0
#endif

/* Where a tile's finished sums go: rows of y (stride ld), plus bias when not NULL. */
typedef struct {
    float *y;
    const float *bias;
    int64_t ld;
} tm_out;

typedef struct tm_gemm tm_gemm;
/* Sums of `rows` rows of x (from `x`) over one panel into c ([rows][64]), or straight into y
 * (out, when not NULL); the last k-chunk prefetches `after`, the panel the caller reads next. */
typedef void (*tm_panel_sums)(const tm_gemm *g, const char *x, int64_t rows,
                              const char *panel, const char *after, float *c,
                              const tm_out *out);

/* A product y[M, N] = x[M, K] @ W^T (+ bias) over panels; glu: y = silu(x @ gate^T) *
 * (x @ up^T), w holding the gate's N / 64 panels and then the up's (a merged gate|up weight),
 * bias (if any) 2N wide. x_row and span are bytes: one row of x, one panel. */
struct tm_gemm {
    const char *x, *w;
    const float *bias;
    float *y;
    int64_t M, N, K, KP, glu, x_row, span;
    tm_panel_sums sums;
};

/* panel_gemm.c: the product, its (panel, row) pairs shared out over the OpenMP threads. */
void tm_panel_gemm(const tm_gemm *g);

/* The tiles of rows [0, M) over panel rows [0, steps) in chunks of kc: as few tiles as
 * 6-row tiles need, their rows as even as possible (32 rows: 6,6,5,5,5,5, not 6,6,6,6,4,4: a
 * tile of r rows keeps 2r (AVX2) sums in flight, and fewer than ~10 leave the FMA units
 * waiting on latency), every strip of columns, chunk by chunk; the tiles of a chunk share
 * out the prefetch of the next one, so the panel streams in order while they compute; the
 * last chunk fetches `after`. TILE(x_rows, panel, k0, k1, c, next, lo, hi, rows, out) runs
 * one tile for `rows` constant; x_stride: elements of x per row. */
#define TM_PANEL_ROWS(TILE, x, x_stride, M, steps, panel, after, c, kc, out)                    \
    do {                                                                                    \
        const int64_t tiles_ = ((M) + 5) / 6, base_ = (M) / tiles_, extra_ = (M) % tiles_;  \
        const int64_t runs_ = tiles_ * (64 / TM_STRIP), lines_ = (kc) * 256 / 64;           \
        for (int64_t k0_ = 0; k0_ < (steps); k0_ += (kc)) {                                 \
            const int64_t k1_ = k0_ + (kc) < (steps) ? k0_ + (kc) : (steps);                \
            const char *next_ = k1_ < (steps) ? (const char *)(panel) + k1_ * 256           \
                                              : (const char *)(after);                      \
            int64_t run_ = 0;                                                               \
            for (int64_t col_ = 0; col_ < 64; col_ += TM_STRIP) {                           \
                int64_t m0_ = 0;                                                            \
                for (int64_t i_ = 0; i_ < tiles_; i_++, run_++) {                           \
                    const int64_t rows_ = base_ + (i_ < extra_);                            \
                    const int64_t lo_ = run_ * lines_ / runs_;                              \
                    const int64_t hi_ = (run_ + 1) * lines_ / runs_;                        \
                    tm_out to_;                                                             \
                    if (out)                                                                \
                        to_ = (tm_out){(out)->y + m0_ * (out)->ld + col_,                   \
                                       (out)->bias ? (out)->bias + col_ : NULL, (out)->ld}; \
                    switch (rows_) {                                                        \
                        TM_TILE_CASE(TILE, 1, x, x_stride, panel, c, out)               \
                        TM_TILE_CASE(TILE, 2, x, x_stride, panel, c, out)               \
                        TM_TILE_CASE(TILE, 3, x, x_stride, panel, c, out)               \
                        TM_TILE_CASE(TILE, 4, x, x_stride, panel, c, out)               \
                        TM_TILE_CASE(TILE, 5, x, x_stride, panel, c, out)               \
                        TM_TILE_CASE(TILE, 6, x, x_stride, panel, c, out)               \
                    }                                                                       \
                    m0_ += rows_;                                                           \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    } while (0)
#define TM_TILE_CASE(TILE, R, x, x_stride, panel, c, out)                                   \
    case R:                                                                                 \
        TILE((x) + m0_ * (x_stride), panel, col_, k0_, k1_, (c) + m0_ * 64 + col_, next_,   \
             lo_, hi_, R, (out) ? &to_ : NULL);                                             \
        break;
