/* The machine's own limits, without any kernel's overheads in the way: the fp32 FMA peak
 * (every thread runs independent fused multiply-adds on registers, enough chains in flight
 * to cover the FMA latency on every port) and the read bandwidth (every thread sums its share
 * of a large array with several accumulators, so loads, not adds, set the pace).
 * bench/roofline.py builds it with the system C compiler and times both. */
#include <immintrin.h>
#include <stdint.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define LOAD _mm512_loadu_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define SUM _mm512_reduce_add_ps
#else
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define LOAD _mm256_loadu_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
static float SUM(__m256 v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
#endif
#define CHAINS 12

/* FLOPs done by all threads; *sink keeps the sums live (the compiler may not drop them). */
double tm_fma_flops(int64_t rounds, float *sink) {
    double flops = 0.0;
    float total = 0.0f;
#pragma omp parallel reduction(+ : flops, total)
    {
        vec acc[CHAINS];
        for (int j = 0; j < CHAINS; j++) acc[j] = SET1(1.0f + 0.01f * j);
        const vec a = SET1(0.9999f), b = SET1(1e-4f);
        for (int64_t r = 0; r < rounds; r++)
            for (int j = 0; j < CHAINS; j++) acc[j] = FMA(acc[j], a, b);
        vec s = acc[0];
        for (int j = 1; j < CHAINS; j++) s = ADD(s, acc[j]);
        total += SUM(s);
        flops += 2.0 * LANES * CHAINS * (double)rounds;
    }
    *sink = total;
    return flops;
}

/* The sum of x[0, n) (n a multiple of 8 x LANES). */
float tm_read_sum(const float *x, int64_t n) {
    const int64_t step = 8 * LANES, blocks = n / step;
    float total = 0.0f;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t t = 0; t < 64; t++) { /* 64 contiguous shares, split between the threads */
        vec acc[8];
        for (int j = 0; j < 8; j++) acc[j] = SET1(0.0f);
        for (int64_t b = blocks * t / 64; b < blocks * (t + 1) / 64; b++)
            for (int j = 0; j < 8; j++) acc[j] = ADD(acc[j], LOAD(x + b * step + j * LANES));
        for (int j = 1; j < 8; j++) acc[0] = ADD(acc[0], acc[j]);
        total += SUM(acc[0]);
    }
    return total;
}
