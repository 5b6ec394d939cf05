/* int8 / int4 weights times int16 activations with the output channels across the lanes.
 *
 * gemm.c's integer kernels put the 32 inputs of a block across the vector lanes: each (row,
 * channel, block) then needs its own int32->float conversion and FMA, as many instructions
 * per multiply-add as an fp32 GEMM. Here a weight is laid out as panels of 16 channels with
 * each channel's input pairs side by side (int8: [N/16][K/2][16][2] bytes; int4: [N/16][K/2]
 * [16] bytes, input 2j in the low nibble, 2j + 1 in the high one), so one widened load is 16
 * channels x 2 inputs and `vpdpwssd` against a broadcast activation pair adds 32 products
 * into 16 per-channel sums; block scales (and int4 mins) are applied once per 16 channels
 * and 32 inputs. Scales per panel: [N/16][K/group][16] (int8 float32, int4 float16 scale and
 * min). On a Zen 4 that is ~1.6x the fp32 panel kernel's multiply-adds per cycle.
 *
 * Same rounding as gemm.c's `_q16` kernels: activations in int16 per 32 inputs
 * (tm_quantize_rows_q16: scales xs, block sums xsum), exact int32 block sums, then per block
 * and row y += float(sum) * (scale[group] * xs[block]) (int4: + min[group] * xsum[block]).
 * Without AVX-512 VNNI the same sums come from vpmaddwd + vpaddd on 8 channels at a time,
 * with the same float operations per lane, so both builds give identical results (the tests
 * run everywhere). K and the group are multiples of 32, or int8 groups of 16 (GGUF Q6_K /
 * Q3_K: each 32-input block's two halves summed apart, each times its own scale).
 *
 * fp4 (MXFP4, gpt-oss' experts): E2M1 codes in panels of 16 channels' 32-bit words, each
 * word 8 inputs of one channel ([N/16][K/8][16] words; inputs 8q + 2t and 8q + 2t + 1 in
 * bits 4t and 16 + 4t), one bfloat16 scale (a power of two: exact) per 16 channels and 32
 * inputs, no min: 4.5 bits a weight where the int8 form of the same weights takes 9. Pair t
 * is the word shifted right by 4t: `vpermw` looks each int16 lane's low five bits up in a
 * table of the codes' values times two (-12..12, repeated: the fifth bit is the next
 * code's), so a pair costs a shift and a lookup, a 64-byte load serves four pairs. */
#include <stdint.h>

#include "kernels.h"
#include "vnni_tile.h"

/* weight value (n, k) of gemm.c's layouts: int8 [N, K]; int4 Q4 [N, K/2], per 32 inputs
 * byte j holding input j (low nibble) and j + 16 (high) */
static inline int int8_at(const void *w, int64_t K, int64_t n, int64_t k) {
    return ((const int8_t *)w)[n * K + k];
}

static inline int int4_at(const void *w, int64_t K, int64_t n, int64_t k) {
    const uint8_t b = ((const uint8_t *)w)[n * (K / 2) + k / 32 * 16 + k % 16];
    return k % 32 < 16 ? b & 15 : b >> 4;
}

/* One loop for both kinds (load-time only). Channels past N are zero. */
static void to_vnni(const void *w, const void *scale, const uint16_t *min, int64_t N,
                    int64_t K, int64_t group, void *wp, void *sp, uint16_t *mp, const int int4) {
    const int64_t panels = (N + VP - 1) / VP, groups = K / group;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int c = 0; c < VP; c++) {
            const int64_t n = p * VP + c;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t at = (p * groups + g) * VP + c, from = n * groups + g;
                if (int4) {
                    ((uint16_t *)sp)[at] = n < N ? ((const uint16_t *)scale)[from] : 0;
                    mp[at] = n < N ? min[from] : 0;
                } else {
                    ((float *)sp)[at] = n < N ? ((const float *)scale)[from] : 0.0f;
                }
            }
            for (int64_t k = 0; k < K; k += 2) {
                const int64_t pair = p * (K / 2) + k / 2;
                if (int4)
                    ((uint8_t *)wp)[pair * VP + c] =
                        n < N ? (uint8_t)(int4_at(w, K, n, k) | int4_at(w, K, n, k + 1) << 4) : 0;
                else
                    for (int j = 0; j < 2; j++)
                        ((int8_t *)wp)[(pair * VP + c) * 2 + j] =
                            n < N ? (int8_t)int8_at(w, K, n, k + j) : 0;
            }
        }
}

void tm_int8_to_vnni(const int8_t *w, const float *scale, int64_t N, int64_t K,
                     int64_t group, int8_t *wp, float *sp) {
    to_vnni(w, scale, NULL, N, K, group, wp, sp, NULL, 0);
}

void tm_int4_to_vnni(const uint8_t *w, const uint16_t *scale, const uint16_t *min, int64_t N,
                     int64_t K, int64_t group, uint8_t *wp, uint16_t *sp, uint16_t *mp) {
    to_vnni(w, scale, min, N, K, group, wp, sp, mp, 1);
}

int64_t tm_vnni_native(void) { return TM_VNNI_NATIVE; }

void tm_int8_vnni_gemm(const int16_t *xq, const float *xs, const int8_t *wp, const float *sp,
                       const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t group) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < (N + VP - 1) / VP; p++)
        vnni_panel(p, xq, xs, xs, wp, sp, NULL, bias, y, M, N, K, group, KIND_INT8);
}

void tm_int4_vnni_gemm(const int16_t *xq, const float *xs, const float *xsum, const uint8_t *wp,
                       const uint16_t *sp, const uint16_t *mp, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int64_t group) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < (N + VP - 1) / VP; p++)
        vnni_panel(p, xq, xs, xsum, wp, sp, mp, bias, y, M, N, K, group, KIND_INT4);
}

void tm_fp4_vnni_gemm(const int16_t *xq, const float *xs, const uint8_t *wp,
                      const uint16_t *sp, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < (N + VP - 1) / VP; p++)
        vnni_panel(p, xq, xs, xs, wp, sp, NULL, bias, y, M, N, K, 32, KIND_FP4);
}
