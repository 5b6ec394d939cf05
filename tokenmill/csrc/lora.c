/* LoRA adapters' products added to a linear layer's output rows (float32, the CPU), as
 * lora/layers.py's LoRALayer lays its slots out:
 *
 *   at [slots][K][width]  slot s's A transposed: projection i's A^T in columns i * r ..
 *   bt [slots][width][ldb] its B transposed: row i * r + j holds B_i[:, j] in the columns of
 *                         projection i (offsets[i] .. offsets[i + 1]), zeros elsewhere; ldb
 *                         >= N, padded off multiples of 1 KiB (an expand reads r rows at
 *                         once: 4 KiB apart, they would share L1 sets and evict each other)
 *
 * with r = ranks[s] (0: no adapter in that slot at this layer) and `slices` projections (q|k|v:
 * 3, gate|up: 2, else 1). For each row t with slot s = slots[t] >= 0:
 *   tmp[t][q] = sum over k of x[t][k] * at[s][k][q]                       (q < slices * r)
 *   y[t][n] += sum over j < r of tmp[t][i * r + j] * bt[s][i * r + j][n]  (n in projection i)
 * The rows are taken in runs of one slot (the runner sorts a step's rows by adapter) and in
 * blocks of ROWS, so each A and B row is read once per block, not once per row; the expand
 * skips the block-diagonal zeros the Python path multiplies. The same products as that path's
 * (x A^T) B^T; the sums run in another order (results equal to rounding, not bit for bit). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* a task's rows; an expand task's output columns; the columns a register holds */
enum { ROWS = 8, COLS = 128, VEC = 16 };

typedef struct {
    int64_t first, count, slot;
} run_t;

/* Runs of consecutive rows of one slot with an adapter here, cut into blocks of ROWS */
static int64_t blocks_of(const int64_t *slots, const int64_t *ranks, int64_t T, run_t *out) {
    int64_t n = 0;
    for (int64_t t = 0; t < T;) {
        const int64_t s = slots[t];
        int64_t end = t + 1;
        while (end < T && slots[end] == s && end - t < ROWS) end++;
        if (s >= 0 && ranks[s] > 0) out[n++] = (run_t){t, end - t, s};
        t = end;
    }
    return n;
}

void tm_lora_add(const float *x, float *y, int64_t T, int64_t K, int64_t N, const float *at,
                 const float *bt, int64_t ldb, int64_t width, int64_t slices,
                 const int64_t *offsets,
                 const int64_t *ranks, const int64_t *slots, float *tmp) {
    run_t stack[64];
    run_t *blocks = T <= 64 ? stack : malloc(T * sizeof(run_t));
    if (blocks == NULL) abort();
    const int64_t nb = blocks_of(slots, ranks, T, blocks);
    /* shrink: a task per block; each row's tmp accumulated in registers, VEC columns at a
     * time, over K (A^T's rows for those columns read once a block) */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < nb; b++) {
        const run_t blk = blocks[b];
        const int64_t w = slices * ranks[blk.slot];
        const float *a = at + blk.slot * K * width;
        for (int64_t q0 = 0; q0 < w; q0 += VEC) {
            const int64_t nq = w - q0 < VEC ? w - q0 : VEC;
            for (int64_t i0 = 0; i0 < blk.count; i0 += 4) {
                const int64_t ni = blk.count - i0 < 4 ? blk.count - i0 : 4;
                float acc[4][VEC] = {{0}};
                const float *xr = x + (blk.first + i0) * K;
                if (nq == VEC && ni == 4) {
                    for (int64_t k = 0; k < K; k++) {
                        const float *arow = a + k * width + q0;
                        for (int64_t i = 0; i < 4; i++) {
                            const float xk = xr[i * K + k];
#pragma omp simd
                            for (int64_t l = 0; l < VEC; l++) acc[i][l] += xk * arow[l];
                        }
                    }
                } else {
                    for (int64_t k = 0; k < K; k++) {
                        const float *arow = a + k * width + q0;
                        for (int64_t i = 0; i < ni; i++) {
                            const float xk = xr[i * K + k];
                            for (int64_t l = 0; l < nq; l++) acc[i][l] += xk * arow[l];
                        }
                    }
                }
                for (int64_t i = 0; i < ni; i++)
                    for (int64_t l = 0; l < nq; l++)
                        tmp[(blk.first + i0 + i) * width + q0 + l] = acc[i][l];
            }
        }
    }
    /* expand: a task per (block, COLS output columns); each output vector accumulated in
     * registers over the rank (the B^T rows of those columns read once a block) */
    const int64_t chunks = (N + COLS - 1) / COLS;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < nb * chunks; task++) {
        const run_t blk = blocks[task / chunks];
        const int64_t n0 = task % chunks * COLS, n1 = n0 + COLS < N ? n0 + COLS : N;
        const int64_t r = ranks[blk.slot];
        const float *b = bt + blk.slot * width * ldb;
        for (int64_t p = 0; p < slices; p++) {
            const int64_t lo = offsets[p] > n0 ? offsets[p] : n0;
            const int64_t hi = offsets[p + 1] < n1 ? offsets[p + 1] : n1;
            for (int64_t i = 0; i < blk.count && lo < hi; i++) {
                const int64_t t = blk.first + i;
                const float *c = tmp + t * width + p * r;
                float *out = y + t * N;
                int64_t n = lo;
                for (; n + VEC <= hi; n += VEC) {
                    float acc[VEC];
#pragma omp simd
                    for (int64_t l = 0; l < VEC; l++) acc[l] = out[n + l];
                    for (int64_t j = 0; j < r; j++) {
                        const float *brow = b + (p * r + j) * ldb + n;
                        const float cj = c[j];
#pragma omp simd
                        for (int64_t l = 0; l < VEC; l++) acc[l] += cj * brow[l];
                    }
#pragma omp simd
                    for (int64_t l = 0; l < VEC; l++) out[n + l] = acc[l];
                }
                for (; n < hi; n++) {
                    float acc = out[n];
                    for (int64_t j = 0; j < r; j++) acc += c[j] * b[(p * r + j) * ldb + n];
                    out[n] = acc;
                }
            }
        }
    }
    if (blocks != stack) free(blocks);
}
