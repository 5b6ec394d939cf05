/* LoRA adapters' products added to a linear layer's output rows, for the compiled decode
 * step (decode_step.c), as lora/layers.py's LoRALayer lays its slots out:
 *
 *   a  [slots][width][K]  slot s's A of projection i in rows i * r .. i * r + r
 *   bt [slots][width][N]  its B transposed: row i * r + j holds B_i[:, j] in the columns of
 *                         projection i (offsets[i] .. offsets[i + 1]), zeros elsewhere
 *
 * with r = ranks[s] (0: no adapter in that slot at this layer) and `slices` projections (q|k|v:
 * 3, gate|up: 2, else 1). For each row t with slot s = slots[t] >= 0:
 *   tmp[t][q] = A[s][q] . x[t]                                  (q < slices * r)
 *   y[t][n] += sum over j < r of tmp[t][i * r + j] * bt[s][i * r + j][n]   (n in projection i)
 * The same products as the Python path's (x A^T) B^T, without its block-diagonal zeros; the
 * sums run in another order (float results equal to rounding, not bit for bit). */
#include <omp.h>
#include <stdint.h>

#include "kernels.h"

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

enum { EXPAND_COLS = 256 }; /* output columns a task expands */

void tm_lora_add(const float *x, float *y, int64_t T, int64_t K, int64_t N, const float *a,
                 const float *bt, int64_t width, int64_t slices, const int64_t *offsets,
                 const int64_t *ranks, const int64_t *slots, float *tmp) {
    /* shrink: a task per (row, rank row of A) */
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < T * width; task++) {
        const int64_t t = task / width, q = task % width, s = slots[t];
        if (s < 0 || q >= slices * ranks[s]) continue;
        tmp[t * width + q] = dot(a + (s * width + q) * K, x + t * K, K);
    }
    /* expand: a task per (row, EXPAND_COLS output columns) */
    const int64_t chunks = (N + EXPAND_COLS - 1) / EXPAND_COLS;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < T * chunks; task++) {
        const int64_t t = task / chunks, n0 = task % chunks * EXPAND_COLS, s = slots[t];
        if (s < 0 || ranks[s] == 0) continue;
        const int64_t r = ranks[s], n1 = n0 + EXPAND_COLS < N ? n0 + EXPAND_COLS : N;
        float *out = y + t * N;
        for (int64_t i = 0; i < slices; i++) {
            const int64_t lo = offsets[i] > n0 ? offsets[i] : n0;
            const int64_t hi = offsets[i + 1] < n1 ? offsets[i + 1] : n1;
            for (int64_t j = 0; j < r && lo < hi; j++) {
                const int64_t q = i * r + j;
                const float c = tmp[t * width + q];
                const float *row = bt + (s * width + q) * N;
#pragma omp simd
                for (int64_t n = lo; n < hi; n++) out[n] += c * row[n];
            }
        }
    }
}
