/* A whole decode step of a Llama-family model's decoder layers in one call.
 *
 * With one token per sequence, a layer's arithmetic is a few milliseconds of weight streaming
 * and every kernel call from Python costs ~5-20 us of interpreter, module and ctypes work:
 * ~12 calls x 30 layers was about as long as the weights' streaming itself (bench/NOTES.md).
 * Here the layer loop runs in C over the same kernels the Python path calls one by one, in
 * the same order with the same roundings, so its outputs equal that path's. The model's
 * tensors are described once (tm_model, filled by tokenmill/models/cpu_decode.py); per step
 * only the token rows and the attention metadata change.
 *
 * Per layer, for T decode tokens (hidden [T, H] holds the layer input; residual [T, H]):
 *   normed = rms_norm(hidden + residual)            (residual += hidden; layer 0: = hidden)
 *   qkv = normed @ Wqkv (+ bias); optional per-head q/k RMSNorm; rotary on q|k in place
 *   write k, v to the cache; attn = paged attention of q over the cache
 *   hidden = attn @ Wo; normed = rms_norm(hidden + residual)
 *   hidden = (silu(normed @ Wgate) * (normed @ Wup)) @ Wdown
 * and at the end out = rms_norm(hidden + residual) with the final norm's weight (a pipeline
 * stage holds some of the layers: see tm_model's first_stage / last_stage).
 *
 * Under tensor parallel each rank holds its heads and its share of the MLP: the outputs of
 * Wo and Wdown are partial sums, added up across the ranks of this node by the shared-memory
 * all-reduce (shm_allreduce.c) right there, as the Python path's RowParallelLinear does. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

enum { TM_F32_PANEL = 0, TM_INT8 = 1, TM_INT8_Q16 = 2, TM_INT4 = 3, TM_INT4_Q16 = 4,
       TM_INT8_VNNI = 5, TM_INT4_VNNI = 6 };

typedef struct {
    int64_t kind, n, k;
    int64_t param; /* TM_F32_PANEL: KP (padded K); int8 / int4: the quantization group */
    const void *w, *scale, *min; /* *_VNNI: vnni_panels.c's panels */
    const float *bias;
} tm_linear;

typedef struct {
    tm_linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms may be NULL */
    void *k_cache, *v_cache;
} tm_layer;

typedef struct {
    int64_t num_layers, hidden, q_heads, kv_heads, head_dim, intermediate, block_size;
    int64_t kv_int8, max_rows;
    float eps, scale;
    const tm_layer *layers;
    const float *final_norm, *cos, *signed_sin;
    /* scratch for max_rows tokens */
    float *residual, *normed, *qkv, *attn, *gate_up, *act, *xs, *xsum;
    int16_t *xq;
    /* tensor parallel (tp_size 1: none): shm_allreduce.c's segment and sequence counter */
    int64_t tp_rank, tp_size, slot_floats;
    char *shm_base;
    int64_t *shm_seq;
    /* pipeline parallel: a stage after the first starts from the previous stage's hidden
     * rows with its residual already in `residual`; a stage before the last ends without the
     * final norm, leaving its hidden rows in `hidden` and their residual in `residual` */
    int64_t first_stage, last_stage;
} tm_model;

static int reduce(const tm_model *m, float *x, int64_t n) {
    if (m->tp_size == 1) return 0;
    return (int)tm_shm_allreduce(m->shm_base, m->tp_rank, m->tp_size, m->slot_floats,
                                 m->shm_seq, x, n);
}

static void linear(const tm_model *m, const tm_linear *l, const float *x, float *y,
                   int64_t T) {
    switch (l->kind) {
        case TM_F32_PANEL:
            tm_f32_panel_gemm(x, l->w, l->bias, y, T, l->n, l->k, l->param);
            break;
        case TM_INT8:
            tm_int8_gemm(x, l->w, l->scale, l->bias, y, T, l->n, l->k, l->param);
            break;
        case TM_INT8_Q16:
            tm_quantize_rows_q16(x, m->xq, m->xs, m->xsum, T, l->k);
            tm_int8_gemm_q16(m->xq, m->xs, l->w, l->scale, l->bias, y, T, l->n, l->k,
                             l->param);
            break;
        case TM_INT8_VNNI:
            tm_quantize_rows_q16(x, m->xq, m->xs, m->xsum, T, l->k);
            tm_int8_vnni_gemm(m->xq, m->xs, l->w, l->scale, l->bias, y, T, l->n, l->k,
                              l->param);
            break;
        case TM_INT4_VNNI:
            tm_quantize_rows_q16(x, m->xq, m->xs, m->xsum, T, l->k);
            tm_int4_vnni_gemm(m->xq, m->xs, m->xsum, l->w, l->scale, l->min, l->bias, y, T,
                              l->n, l->k, l->param);
            break;
        case TM_INT4:
            tm_int4_gemm(x, l->w, l->scale, l->min, l->bias, y, T, l->n, l->k, l->param);
            break;
        case TM_INT4_Q16:
            tm_quantize_rows_q16(x, m->xq, m->xs, m->xsum, T, l->k);
            tm_int4_gemm_q16(m->xq, m->xs, m->xsum, l->w, l->scale, l->min, l->bias, y, T,
                             l->n, l->k);
            break;
    }
}

/* Returns 0, -1 when T is outside 1..max_rows (nothing is touched then), or -2 when a
 * tensor-parallel all-reduce was aborted (a rank died). */
int64_t tm_decode_layers(const tm_model *m, float *hidden, float *out, int64_t T,
                         const int64_t *positions, const int64_t *slots,
                         const int64_t *block_table, int64_t table_stride,
                         const int64_t *seq_lens) {
    if (T < 1 || T > m->max_rows) return -1;
    const int64_t H = m->hidden, D = m->head_dim, hq = m->q_heads, hkv = m->kv_heads;
    const int64_t q_size = hq * D, kv_size = hkv * D, width = q_size + 2 * kv_size;
    for (int64_t i = 0; i < m->num_layers; i++) {
        const tm_layer *layer = m->layers + i;
        if (i == 0 && m->first_stage) {
            memcpy(m->residual, hidden, T * H * sizeof(float));
            tm_add_rms_norm(hidden, NULL, layer->input_norm, m->normed, T, H, m->eps);
        } else {
            tm_add_rms_norm(hidden, m->residual, layer->input_norm, m->normed, T, H, m->eps);
        }
        linear(m, &layer->qkv, m->normed, m->qkv, T);
        if (layer->q_norm) /* per head, in place: each row is read before it is written */
            for (int64_t t = 0; t < T; t++) {
                float *row = m->qkv + t * width;
                tm_add_rms_norm(row, NULL, layer->q_norm, row, hq, D, m->eps);
                tm_add_rms_norm(row + q_size, NULL, layer->k_norm, row + q_size, hkv, D,
                                m->eps);
            }
        tm_rotary(m->qkv, T, hq + hkv, D, width, m->cos, m->signed_sin, positions);
        tm_write_kv(m->qkv + q_size, m->qkv + q_size + kv_size, width, width, layer->k_cache,
                    layer->v_cache, slots, T, hkv, D, m->kv_int8);
        tm_paged_decode_attention(m->qkv, width, layer->k_cache, layer->v_cache, block_table,
                                  table_stride, seq_lens, m->attn, T, hq, hkv, D,
                                  m->block_size, m->scale, m->kv_int8);
        linear(m, &layer->o, m->attn, hidden, T);
        if (reduce(m, hidden, T * H)) return -2;
        tm_add_rms_norm(hidden, m->residual, layer->post_norm, m->normed, T, H, m->eps);
        if (layer->gate_up.kind != TM_F32_PANEL ||
            tm_f32_panel_glu(m->normed, layer->gate_up.w, layer->gate_up.bias, m->act, T,
                             m->intermediate, H, layer->gate_up.param) != 0) {
            linear(m, &layer->gate_up, m->normed, m->gate_up, T);
            tm_silu_and_mul(m->gate_up, m->act, T, m->intermediate);
        }
        linear(m, &layer->down, m->act, hidden, T);
        if (reduce(m, hidden, T * H)) return -2;
    }
    if (m->last_stage) tm_add_rms_norm(hidden, m->residual, m->final_norm, out, T, H, m->eps);
    return 0;
}
