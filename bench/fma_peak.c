/* The CPU's fp32 FMA peak: every thread runs independent fused multiply-adds on registers
 * (no memory traffic), enough chains in flight to cover the FMA latency on every port.
 * bench/roofline.py builds it with the system compiler and times tm_fma_flops. */
#include <immintrin.h>
#include <stdint.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define SUM _mm512_reduce_add_ps
#else
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
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
