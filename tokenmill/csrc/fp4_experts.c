/* A mixture-of-experts layer's routed experts over fp4 panels (gpt-oss' MXFP4 experts) in one
 * call: each of the step's M token rows goes to its top_k experts, each expert's rows through
 * gate and up, gpt-oss' clamped SwiGLU, down, and back weighted into the token's row.
 *
 * The per-expert loop in torch (layers/moe.py's `grouped_experts`, the reference) spends as
 * long between the products as in them at batch 1 (about twenty torch calls an expert, the
 * weights idle meanwhile); here a layer is two parallel loops over every active expert's
 * panels, with the activations quantized once. Same order as the reference: assignments
 * sorted by expert (stable: tokens in order within one), the products and their biases by
 * vnni_tile.h's kernel (the same int32 sums and float operations as `tm_fp4_vnni_gemm`), the
 * activation as its torch formula, then out[token] += y * weight in expert order. The
 * activation's sigmoid uses expf where torch has its own exp: outputs agree to about one
 * float ulp of the activation, not bit for bit.
 *
 * parts [E][9]: per expert the addresses of gate's panels, panel scales and bias (0: none),
 * then up's, then down's (csrc/vnni.py `fp4_experts`); x [M, H], ids / weights [M, top_k],
 * out [M, H] float32; H and I multiples of 32. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vnni_tile.h"

/* one fp4 product for the rows [s, s + rows) of the gathered inputs (q16 rows of K) */
INLINE void expert_panel(const int64_t *part, int64_t p, const int16_t *q, const float *qs,
                         int64_t s, int64_t rows, float *y, int64_t N, int64_t K) {
    vnni_panel(p, q + s * K, qs + s * (K / 32), qs + s * (K / 32), (const void *)part[0],
               (const void *)part[1], NULL, (const float *)part[2], y + s * N, rows, N, K, 32,
               KIND_FP4);
}

void tm_fp4_experts(const float *x, int64_t M, int64_t H, int64_t I, int64_t top_k,
                    const int64_t *ids, const float *weights, int64_t E, const int64_t *parts,
                    float alpha, float limit, float *out) {
    const int64_t A = M * top_k, hb = H / 32, ib = I / 32;
    /* the assignments sorted by expert (counting sort: stable), and the runs of one expert */
    int64_t *at = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)A * sizeof(int64_t));
    int64_t *run = malloc((size_t)(A + 1) * sizeof(int64_t)), runs = 0;
    for (int64_t a = 0; a < A; a++) at[ids[a] + 1]++;
    for (int64_t e = 0; e < E; e++) at[e + 1] += at[e];
    for (int64_t a = 0; a < A; a++) order[at[ids[a]]++] = a;
    for (int64_t i = 0; i < A; i++)
        if (i == 0 || ids[order[i]] != ids[order[i - 1]]) run[runs++] = i;
    run[runs] = A;
    /* the inputs rounded to int16 once, then gathered in assignment order */
    int16_t *xq = malloc((size_t)M * H * sizeof(int16_t));
    int16_t *gq = malloc((size_t)A * (H > I ? H : I) * sizeof(int16_t));
    float *xs = malloc((size_t)M * hb * 2 * sizeof(float)); /* (scales, then block sums) */
    float *gs = malloc((size_t)A * (hb > ib ? hb : ib) * 2 * sizeof(float));
    tm_quantize_rows_q16(x, xq, xs, xs + M * hb, M, H);
    for (int64_t i = 0; i < A; i++) {
        const int64_t r = order[i] / top_k;
        memcpy(gq + i * H, xq + r * H, (size_t)H * sizeof(int16_t));
        memcpy(gs + i * hb, xs + r * hb, (size_t)hb * sizeof(float));
    }
    float *gate = malloc((size_t)A * I * 2 * sizeof(float)), *up = gate + A * I;
    float *y = malloc((size_t)A * H * sizeof(float));
    const int64_t p1 = I / VP, p2 = (H + VP - 1) / VP;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < runs * 2 * p1; item++) {
        const int64_t g = item / (2 * p1), which = item / p1 % 2, s = run[g];
        expert_panel(parts + ids[order[s]] * 9 + 3 * which, item % p1, gq, gs, s,
                     run[g + 1] - s, which ? up : gate, I, H);
    }
    /* (up + 1) * (gate * sigmoid(gate * alpha)), gate clamped above, up both ways */
    for (int64_t i = 0; i < A * I; i++) {
        const float g = gate[i] > limit ? limit : gate[i];
        const float u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
        const float sig = 1.0f / (1.0f + expf(-(g * alpha)));
        gate[i] = (u + 1.0f) * (g * sig);
    }
    tm_quantize_rows_q16(gate, gq, gs, gs + A * ib, A, I);
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < runs * p2; item++) {
        const int64_t g = item / p2, s = run[g];
        expert_panel(parts + ids[order[s]] * 9 + 6, item % p2, gq, gs, s, run[g + 1] - s, y, H,
                     I);
    }
    memset(out, 0, (size_t)M * H * sizeof(float));
    for (int64_t i = 0; i < A; i++) {
        float *o = out + order[i] / top_k * H;
        const float w = weights[order[i]];
        for (int64_t h = 0; h < H; h++) o[h] += y[i * H + h] * w;
    }
    free(at), free(order), free(run), free(xq), free(gq), free(xs), free(gs), free(gate), free(y);
}
