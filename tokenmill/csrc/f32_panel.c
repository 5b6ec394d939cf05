/* fp32 linear layers in oneDNN's packed layout: y[M, N] = x[M, K] @ W^T (+ bias).
 *
 * fp32 layers keep their weight in the layout torch.ops.mkldnn._reorder_linear_weight gives
 * (one copy; oneDNN runs the layers this kernel cannot read): panels of 64 output channels,
 * each [KP][64] with K zero-padded to KP ([N/64][KP][64]; csrc.f32_panel_stride derives KP and
 * layers check this kernel against oneDNN once before using it). oneDNN's own single-row GEMV
 * reads it at ~12 GB/s here; one pass per panel with 8 accumulators reaches the machine's
 * streaming rate. From 2 rows on, register tiles of up to 6 rows walk k-chunks of the panel
 * that stay in L1 while every tile of the chunk uses them, with the next chunk prefetched in
 * memory order (strips read alone would stride through the panel and defeat the hardware
 * prefetcher). On AVX2 a tile is 16 columns wide (12 sums in registers); with AVX-512 it spans
 * the whole 64-column panel (24 of the 32 zmm registers), so each weight is loaded once per
 * tile instead of being re-read, with fewer loads per FMA: on a Zen 4 that moved the 16-2048
 * row range from 0.8-0.9x oneDNN's AVX-512 kernels to at least par (bench/NOTES.md).
 * Every tile adds each product in k order with one FMA, in either ISA, so a row's result
 * does not depend on how many rows run with it, and equals the single-row pass. Tiles keep
 * their sums in a per-thread buffer between k-chunks and store the last chunk's straight
 * into y (+ bias), between their FMAs rather than in a copy pass after them (2,048-row
 * prompts 1.02x). tm_f32_panel_glu runs a merged gate|up weight with the MLP's activation
 * applied to the sums: the [M, 2I] product never reaches memory (1.07-1.11x for gate|up and
 * the SiLU pass together from 16 rows up). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

#define TM_MAX_ROWS 32 /* rows per pass: their x chunk and the panel chunk share L1 */

/* A tile prefetches its share of the next chunk, lines [lo, hi), spread evenly over its n
 * k-steps (16.16 fixed point, so no division in the loop). Every tile of a chunk takes an
 * equal share: the weight streams at an even rate while the tiles compute. When the first
 * tile fetched the whole next chunk in a burst, small row counts waited on memory (the
 * default model's 120 projections streaming, AVX-512: 12-24 rows 1.15-1.24x faster spread,
 * 48-2048 rows the same; bench/NOTES.md). */
#define FETCH_PLAN(lo, hi, n) \
    const int64_t fetch_step = ((hi) - (lo)) * 65536 / (n); \
    int64_t fetch_due = (lo) * 65536
#define FETCH_DUE(fetch, lo, hint) \
    for (fetch_due += fetch_step; (lo) < fetch_due >> 16; (lo)++) \
        _mm_prefetch((const char *)((fetch) + (lo) * 16), hint)

/* Where a tile's finished sums go: rows of y (stride ld), plus bias when not NULL. */
typedef struct {
    float *y;
    const float *bias;
    int64_t ld;
} tm_out;

#ifdef __AVX512F__
/* c[0 .. mr, 0 .. 64) += x rows times panel rows [k0, k1): mr x 4 zmm sums. Cache lines
 * [lo, hi) of `fetch` (the next chunk) are prefetched evenly over the k loop, into
 * L2: a 32 KB chunk being used already fills L1, and an L1 hint evicted it (the default
 * model's 120 projections streaming from memory: 16-64 rows 4-10 % faster with T1 than T0). */
INLINE void f32_panel_tile(const float *x, int64_t K, const float *panel, int64_t k0,
                           int64_t k1, float *c, const float *fetch, int64_t lo, int64_t hi,
                           const int mr, const tm_out *out) {
    __m512 acc[6][4];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++)
            acc[i][v] = k0 ? _mm512_load_ps(c + i * 64 + 16 * v) : _mm512_setzero_ps();
    FETCH_PLAN(lo, hi, k1 - k0);
    for (int64_t k = k0; k < k1; k++) {
        FETCH_DUE(fetch, lo, _MM_HINT_T1);
        __m512 w[4];
        for (int v = 0; v < 4; v++) w[v] = _mm512_loadu_ps(panel + k * 64 + 16 * v);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++) {
            const __m512 xb = _mm512_set1_ps(x[i * K + k]);
            for (int v = 0; v < 4; v++) acc[i][v] = _mm512_fmadd_ps(xb, w[v], acc[i][v]);
        }
    }
    if (out && k1 == K) { /* last chunk: the sums (+ bias) go straight to y */
        __m512 b[4];
        for (int v = 0; v < 4; v++)
            b[v] = out->bias ? _mm512_loadu_ps(out->bias + 16 * v) : _mm512_setzero_ps();
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++)
            for (int v = 0; v < 4; v++)
                _mm512_storeu_ps(out->y + i * out->ld + 16 * v,
                                 out->bias ? _mm512_add_ps(acc[i][v], b[v]) : acc[i][v]);
        return;
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++) _mm512_store_ps(c + i * 64 + 16 * v, acc[i][v]);
}
#define TM_STRIP 64 /* columns a tile covers */
/* Panel rows per k-chunk for a product of M rows: 128 (32 KB) where many rows reuse the chunk,
 * so each tile reloads its sums half as often as with 64 (2-10 % faster from 64 to 2048 rows
 * on a Zen 4); 64 (16 KB) from 32 rows down, where a chunk's tiles finish sooner than its
 * successor arrives from memory: 12-32 rows 1.04-1.08x (interleaved A/B, bench/NOTES.md). */
#define TM_KC(M) ((M) <= 32 ? 64 : 128)
#else
/* c[0 .. mr, col .. col+16) += x rows times panel rows [k0, k1): mr x 2 ymm sums. Cache lines
 * [lo, hi) of `fetch` (the next chunk) are prefetched evenly over the k loop. */
INLINE void f32_panel_tile(const float *x, int64_t K, const float *panel, int64_t k0,
                           int64_t k1, float *c, const float *fetch, int64_t lo, int64_t hi,
                           const int mr, const tm_out *out) {
    __m256 acc[6][2];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++) {
        acc[i][0] = k0 ? _mm256_load_ps(c + i * 64) : _mm256_setzero_ps();
        acc[i][1] = k0 ? _mm256_load_ps(c + i * 64 + 8) : _mm256_setzero_ps();
    }
    FETCH_PLAN(lo, hi, k1 - k0);
    for (int64_t k = k0; k < k1; k++) {
        FETCH_DUE(fetch, lo, _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(panel + k * 64);
        const __m256 w1 = _mm256_loadu_ps(panel + k * 64 + 8);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * K + k);
            acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
        }
    }
    if (out && k1 == K) { /* last chunk: the sums (+ bias) go straight to y */
        const __m256 b0 = out->bias ? _mm256_loadu_ps(out->bias) : _mm256_setzero_ps();
        const __m256 b1 = out->bias ? _mm256_loadu_ps(out->bias + 8) : _mm256_setzero_ps();
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++) {
            _mm256_storeu_ps(out->y + i * out->ld, out->bias ? _mm256_add_ps(acc[i][0], b0) : acc[i][0]);
            _mm256_storeu_ps(out->y + i * out->ld + 8, out->bias ? _mm256_add_ps(acc[i][1], b1) : acc[i][1]);
        }
        return;
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++) {
        _mm256_store_ps(c + i * 64, acc[i][0]);
        _mm256_store_ps(c + i * 64 + 8, acc[i][1]);
    }
}
#define TM_STRIP 16
#define TM_KC(M) 64 /* panel rows per k-chunk (16 KB): the 4 strips' tiles share it in L1 */
#endif

/* One row over a whole panel (64 columns, 8 accumulators): a single sequential pass, what a
 * memory-bound GEMV wants, with a software prefetch ROW_AHEAD panel rows (4 KB) ahead, into
 * the next panel at the end (the hardware prefetcher alone: ~80 % of the read bandwidth on an
 * Intel Xeon; with it the f32 Qwen2.5-0.5B-shaped decode went 12.4 -> 15.0 tok/s, at the
 * measured bandwidth; bench/NOTES.md, 2026-11-27). Same k-order FMA sums as the tiles. */
#define ROW_AHEAD 16
static void f32_panel_row(const float *x, int64_t K, const float *panel, float *c) {
    __m256 acc[8];
    for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        for (int v = 0; v < 4; v++) /* the 4 lines of a panel row */
            _mm_prefetch((const char *)(panel + (k + ROW_AHEAD) * 64 + 16 * v), _MM_HINT_T0);
        for (int v = 0; v < 8; v++)
            acc[v] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(panel + k * 64 + 8 * v), acc[v]);
    }
    for (int v = 0; v < 8; v++) _mm256_store_ps(c + 8 * v, acc[v]);
}

/* Panel p for all M rows: k-chunk by k-chunk, every strip of columns and every tile of rows
 * (sums kept in c, [M][64], between chunks); the tiles of a chunk share out the prefetch of
 * the next one, so the panel streams in order while they compute; the last chunk fetches the
 * start of the next panel, which follows in memory (the thread's next one, or past its range
 * or the weight's end: a prefetch never faults). */
static void f32_panel_rows(const float *x, int64_t M, int64_t K, const float *panel,
                           const float *after, float *c, const int64_t kc, const tm_out *out) {
    /* as few tiles as 6-row tiles need, their rows as even as possible (32 rows:
     * 6,6,5,5,5,5, not 6,6,6,6,4,4): a tile of r rows keeps 2r (AVX2) sums in flight, and
     * fewer than ~10 leave the FMA units waiting on latency */
    const int64_t tiles = (M + 5) / 6, base = M / tiles, extra = M % tiles;
    const int64_t runs = tiles * (64 / TM_STRIP), lines = kc * 64 / 16;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t k1 = k0 + kc < K ? k0 + kc : K;
        const float *next = k1 < K ? panel + k1 * 64 : after;
        int64_t run = 0;
        for (int64_t col = 0; col < 64; col += TM_STRIP) {
            int64_t m0 = 0;
            for (int64_t i = 0; i < tiles; i++, run++) {
                const int64_t rows = base + (i < extra);
                const int64_t lo = run * lines / runs, hi = (run + 1) * lines / runs;
                tm_out to;
                if (out)
                    to = (tm_out){out->y + m0 * out->ld + col, out->bias ? out->bias + col : NULL,
                                  out->ld};
                switch (rows) {
#define TILE(R) case R: f32_panel_tile(x + m0 * K, K, panel + col, k0, k1, c + m0 * 64 + col, \
                                       next, lo, hi, R, out ? &to : NULL); break;
                    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#undef TILE
                }
                m0 += rows;
            }
        }
    }
}

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

/* A product's operands; glu: y = silu(x @ gate^T) * (x @ up^T), w holding the gate's N / 64
 * panels and then the up's (a merged gate|up weight), bias (if any) 2N wide. */
typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t M, N, K, KP, glu;
} tm_gemm;

/* Sums of `rows` rows of x over one panel into c ([rows][64]), or straight into y (out);
 * the last k-chunk prefetches `after`, the panel the caller reads next. */
static void panel_sums(const tm_gemm *g, const float *x, int64_t rows, const float *panel,
                       const float *after, float *c, const tm_out *out) {
    if (rows == 1)
        f32_panel_row(x, g->K, panel, c);
    else
        f32_panel_rows(x, rows, g->K, panel, after, c, TM_KC(g->M), out);
}

/* y rows [r0, r1) of panel p (glu: of the p-th gate and up panels). */
static void f32_panel_part(const tm_gemm *g, int64_t p, int64_t r0, int64_t r1, float *c,
                           float *c2) {
    const int64_t N = g->N, K = g->K, span = g->KP * 64;
    const int64_t width = N - p * 64 < 64 ? N - p * 64 : 64;
    const float *panel = g->w + p * span, *bias = g->bias ? g->bias + p * 64 : NULL;
    for (int64_t m0 = r0; m0 < r1; m0 += TM_MAX_ROWS) {
        const int64_t rows = r1 - m0 < TM_MAX_ROWS ? r1 - m0 : TM_MAX_ROWS;
        const float *x = g->x + m0 * K;
        float *out = g->y + m0 * N + p * 64;
        if (g->glu) { /* gate sums, up sums, then silu(gate) * up in 8-lane steps */
            const float *up = panel + N / 64 * span, *up_bias = bias ? bias + N : NULL;
            panel_sums(g, x, rows, panel, up, c, NULL);
            panel_sums(g, x, rows, up, panel + span, c2, NULL);
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
            panel_sums(g, x, rows, panel, panel + span, c, &to);
            continue;
        }
        panel_sums(g, x, rows, panel, panel + span, c, NULL);
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < width; j++)
                out[i * N + j] = c[i * 64 + j] + (bias ? bias[j] : 0.0f);
    }
}

static void panel_gemm(const tm_gemm *g) {
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
        panel_gemm(&half);
        half.x += M / 2 * g->K, half.y += M / 2 * g->N, half.M = M - M / 2;
        panel_gemm(&half);
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
            f32_panel_part(g, first / M, first % M, first % M + taken, c, c2);
        for (;;) {
            int64_t victim = -1, most = 0;
            for (int64_t v = 0; v < n; v++) {
                const uint64_t r = __atomic_load_n(&shares[v].range, __ATOMIC_ACQUIRE);
                const int64_t left = (int64_t)(r >> 32) - (int64_t)(r & 0xffffffffu);
                if (left > most) most = left, victim = v;
            }
            if (victim < 0) break; /* every share is empty */
            if ((taken = claim(&shares[victim], M, 1, &first)) > 0) /* else: raced, look again */
                f32_panel_part(g, first / M, first % M, first % M + taken, c, c2);
        }
    }
}

void tm_f32_panel_gemm(const float *x, const float *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int64_t KP) {
    const tm_gemm g = {x, w, bias, y, M, N, K, KP, 0};
    panel_gemm(&g);
}

/* act[M, I] = silu(x @ Wgate^T + bg) * (x @ Wup^T + bu) for a merged gate|up weight of 2I
 * output channels, I a multiple of 64 (-1 otherwise): each gate panel's sums meet their up
 * panel's in registers, so the [M, 2I] product is never written and read back. Bitwise the
 * same as tm_f32_panel_gemm then tm_silu_and_mul. */
int64_t tm_f32_panel_glu(const float *x, const float *w, const float *bias, float *act,
                         int64_t M, int64_t I, int64_t K, int64_t KP) {
    if (I % 64) return -1;
    const tm_gemm g = {x, w, bias, act, M, I, K, KP, 1};
    panel_gemm(&g);
    return 0;
}
