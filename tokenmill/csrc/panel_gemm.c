/* A panel GEMM's schedule over the OpenMP threads, whatever the weights' element type
 * (panel.h): y rows of each panel from the type's sums, written with bias, or as
 * silu(gate) * up for a merged gate|up weight. */
#include <omp.h>
#include <stdint.h>

#include "panel.h"

/* One thread's share of the (panel, row) pairs, [next, end) in one word: its owner claims
 * from the front and a thread out of work from the back, each with a compare-and-swap. */
typedef struct {
    uint64_t range;
} __attribute__((aligned(64))) tm_share; /* a cache line each: no false sharing */

static inline uint64_t share_range(int64_t next, int64_t end) {
    return (uint64_t)next | (uint64_t)end << 32;
}

/* Claims the pairs of share s up to the next panel boundary from the front (or from the
 * back, down to the last boundary): the count taken (0: the share is empty), the first pair
 * in *first. Claims never cross a panel, and shares of whole panels stay whole. */
static int64_t claim(tm_share *s, int64_t M, int back, int64_t *first) {
    uint64_t old = __atomic_load_n(&s->range, __ATOMIC_ACQUIRE);
    for (;;) {
        const int64_t next = (int64_t)(old & 0xffffffffu), end = (int64_t)(old >> 32);
        if (next >= end) return 0;
        const int64_t edge = back ? (end - 1) / M * M : (next / M + 1) * M;
        const int64_t lo = back ? (edge > next ? edge : next) : next;
        const int64_t hi = back ? end : (edge < end ? edge : end);
        const uint64_t rest = back ? share_range(next, lo) : share_range(hi, end);
        if (__atomic_compare_exchange_n(&s->range, &old, rest, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            *first = lo;
            return hi - lo;
        }
    }
}

/* y rows [r0, r1) of panel p (glu: of the p-th gate and up panels). */
static void panel_part(const tm_gemm *g, int64_t p, int64_t r0, int64_t r1, float *c,
                       float *c2) {
    const int64_t N = g->N, span = g->span;
    const int64_t width = N - p * 64 < 64 ? N - p * 64 : 64;
    const char *panel = g->w + p * span;
    const float *bias = g->bias ? g->bias + p * 64 : NULL;
    for (int64_t m0 = r0; m0 < r1; m0 += TM_MAX_ROWS) {
        const int64_t rows = r1 - m0 < TM_MAX_ROWS ? r1 - m0 : TM_MAX_ROWS;
        const char *x = g->x + m0 * g->x_row;
        float *out = g->y + m0 * N + p * 64;
        if (g->glu) { /* gate sums, up sums, then silu(gate) * up in 8-lane steps */
            const char *up = panel + N / 64 * span;
            const float *up_bias = bias ? bias + N : NULL;
            g->sums(g, x, rows, panel, up, c, NULL);
            g->sums(g, x, rows, up, panel + span, c2, NULL);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < 64; j += 8) {
                    __m256 gv = _mm256_load_ps(c + i * 64 + j);
                    __m256 uv = _mm256_load_ps(c2 + i * 64 + j);
                    if (bias) {
                        gv = _mm256_add_ps(gv, _mm256_loadu_ps(bias + j));
                        uv = _mm256_add_ps(uv, _mm256_loadu_ps(up_bias + j));
                    }
                    _mm256_storeu_ps(out + i * N + j, silu_mul8(gv, uv));
                }
            continue;
        }
        if (rows > 1 && width == 64) { /* the tiles store their rows of y themselves */
            const tm_out to = {out, bias, N};
            g->sums(g, x, rows, panel, panel + span, c, &to);
            continue;
        }
        g->sums(g, x, rows, panel, panel + span, c, NULL);
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < width; j++)
                out[i * N + j] = c[i * 64 + j] + (bias ? bias[j] : 0.0f);
    }
}

void tm_panel_gemm(const tm_gemm *g) {
    const int64_t M = g->M, panels = (g->N + 63) / 64;
    if (M <= 0) return;
    /* Work: (panel, row) pairs in panel-major order, cut into one contiguous share per
     * thread. Below 12 rows a share is whole panels (memory-bound: a panel is read by one
     * thread only). From 12 rows on, compute dominates: a share may end inside a panel's
     * rows, so that few panels (9 for a 576-wide layer) still divide evenly while most
     * panels run whole, in 5-6-row tiles (two threads each taking half the rows of every
     * panel ran 4-row tiles at 16 rows: 37.6 ms instead of 27.9 for the default model's 120
     * projections on AVX2). Each thread walks its share panel by panel from the front (in
     * memory order, as the prefetches expect); one that runs out takes panels from the back
     * of the fullest share left, so a thread slowed down (by memory, or by another process
     * on its core) no longer holds the others at the closing barrier. */
    if (panels * M >= (int64_t)1 << 32) { /* more pairs than a packed range holds */
        tm_gemm half = *g;
        half.M = M / 2;
        tm_panel_gemm(&half);
        half.x += M / 2 * g->x_row, half.y += M / 2 * g->N, half.M = M - M / 2;
        tm_panel_gemm(&half);
        return;
    }
    const int64_t unit = M >= 12 ? 1 : M, units = panels * M / unit;
    const int64_t n = omp_get_max_threads();
    tm_share shares[n > 0 ? n : 1];
    for (int64_t t = 0; t < n; t++)
        shares[t].range = share_range(units * t / n * unit, units * (t + 1) / n * unit);
#pragma omp parallel
    {
        float c[TM_MAX_ROWS * 64] __attribute__((aligned(64)));
        float c2[TM_MAX_ROWS * 64] __attribute__((aligned(64))); /* glu: the up sums */
        const int64_t t = omp_get_thread_num();
        int64_t first, taken;
        /* threads beyond the shares (none with the default team size) only take from others */
        while (t < n && (taken = claim(&shares[t], M, 0, &first)) > 0)
            panel_part(g, first / M, first % M, first % M + taken, c, c2);
        for (;;) {
            int64_t victim = -1, most = 0;
            for (int64_t v = 0; v < n; v++) {
                const uint64_t r = __atomic_load_n(&shares[v].range, __ATOMIC_ACQUIRE);
                const int64_t left = (int64_t)(r >> 32) - (int64_t)(r & 0xffffffffu);
                if (left > most) most = left, victim = v;
            }
            if (victim < 0) break; /* every share is empty */
            if ((taken = claim(&shares[victim], M, 1, &first)) > 0) /* else: raced, look again */
                panel_part(g, first / M, first % M, first % M + taken, c, c2);
        }
    }
}
