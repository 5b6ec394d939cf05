/* A whole decode step of a Llama-family model's decoder layers in one call.
 *
 * With one token per sequence, a layer's arithmetic is a few milliseconds of weight streaming
 * and every kernel call from Python costs ~5-20 us of interpreter, module and ctypes work:
 * ~12 calls x 30 layers was about as long as the weights' streaming itself (bench/NOTES.md).
 * Here the layer loop runs in C over the same kernels the Python path calls one by one, in
 * the same order with the same roundings, so its outputs equal that path's. The model's
 * tensors are described once (tm_model, filled by tokenmill/worker/cpu_decode_step.py); per step
 * only the token rows and the attention metadata change.
 *
 * Per layer, for T decode tokens (hidden [T, H] holds the layer input; residual [T, H]):
 *   normed = rms_norm(hidden + residual)            (residual += hidden; layer 0: = hidden)
 *   qkv = normed @ Wqkv (+ bias); optional per-head q/k RMSNorm; rotary on q|k in place
 *   write k, v to the cache; attn = paged attention of q over the cache
 *   hidden = attn @ Wo; normed = rms_norm(hidden + residual)
 *   hidden = (silu(normed @ Wgate) * (normed @ Wup)) @ Wdown   (or a mixture of experts)
 * and at the end out = rms_norm(hidden + residual) with the final norm's weight (a pipeline
 * stage holds some of the layers: see tm_model's first_stage / last_stage).
 *
 * Under tensor parallel each rank holds its heads and its share of the MLP: the outputs of
 * Wo and Wdown are partial sums, added up across the ranks of this node by the shared-memory
 * all-reduce (shm_allreduce.c) right there, as the Python path's RowParallelLinear does. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

enum { TM_F32_PANEL = 0, TM_INT8 = 1, TM_INT8_Q16 = 2, TM_INT4 = 3, TM_INT4_Q16 = 4,
       TM_INT8_VNNI = 5, TM_INT4_VNNI = 6, TM_KQUANT = 7, TM_PARTS = 8, TM_BF16_PANEL = 9 };

/* A linear layer's LoRA adapter slots (lora.c's layout), or none */
typedef struct {
    const float *at, *bt;
    int64_t ldb, width, slices;
    const int64_t *offsets, *ranks;
} tm_lora;

typedef struct {
    int64_t kind, n, k;
    int64_t param; /* TM_F32_PANEL, TM_BF16_PANEL: KP (padded K); int8 / int4: the
                    * quantization group; KQUANT: which K-quant (kquant_panels.c's kinds) */
    /* *_VNNI: vnni_panels.c's panels; KQUANT: one blob; PARTS: `param` tm_linears, a
     * merged layer's parts in different formats, their outputs side by side */
    const void *w, *scale, *min;
    const float *bias;
    const tm_lora *lora; /* NULL: no adapter targets the layer */
} tm_linear;

/* A mixture-of-experts block with a softmax top-k router (Mixtral, Qwen2-MoE, Qwen3-MoE) in
 * place of the MLP, as layers/moe.py runs it: softmax over the router's logits, the k most
 * probable experts (ties: the lower index), renormalized to sum 1 when asked, times
 * `scaling`; each active expert runs once over its tokens (in token order), experts in
 * ascending order, each output times its weight added into the block's output; then the
 * shared expert (Qwen2-MoE's scaled by sigmoid(shared_gate)) is added, and the partial sums
 * of the tensor-parallel ranks are added up once. */
typedef struct {
    int64_t num_experts, top_k, renormalize, inter, shared_inter;
    float scaling;
    tm_linear router;                /* [experts, H], float */
    const tm_linear *gate_up, *down; /* per expert; kind -1: another rank holds it */
    tm_linear shared_gate_up, shared_down; /* kind -1: none */
    const float *shared_gate;              /* [H] (Qwen2-MoE) or NULL */
} tm_moe;

typedef struct {
    tm_linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms may be NULL */
    void *k_cache, *v_cache;
    const tm_moe *moe; /* NULL: the MLP of gate_up / down */
} tm_layer;

/* One thread's scratch for the linear layers and MLPs it runs (max_rows rows) */
typedef struct {
    float *gate_up, *act, *xs, *xsum, *rows_in, *part_out;
    int16_t *xq; /* (int8 [rows][2][K] for the K-quant kernels) */
    int32_t *hsum;
    /* LoRA: each row's adapter slot (-1: none) this step, NULL when no row has one; the
     * shrunk rows [rows][widest width] */
    const int64_t *lora_slots;
    float *lora_tmp;
} tm_scratch;

typedef struct {
    int64_t num_layers, hidden, q_heads, kv_heads, head_dim, intermediate, block_size;
    int64_t kv_kind, max_rows;
    float eps, scale;
    const tm_layer *layers;
    const float *final_norm, *cos, *signed_sin;
    /* scratch for max_rows tokens (`scratch`: the linear layers' and MLPs'; no rows_in) */
    float *residual, *normed, *qkv, *attn;
    tm_scratch scratch;
    /* tensor parallel (tp_size 1: none): shm_allreduce.c's segment and sequence counter */
    int64_t tp_rank, tp_size, slot_floats;
    char *shm_base;
    int64_t *shm_seq;
    /* pipeline parallel: a stage after the first starts from the previous stage's hidden
     * rows with its residual already in `residual`; a stage before the last ends without the
     * final norm, leaving its hidden rows in `hidden` and their residual in `residual` */
    int64_t first_stage, last_stage;
    /* mixture-of-experts scratch (max_rows rows): router logits, the chosen experts and
     * weights (top_k a row); the assignments grouped by expert (their tokens, weights and
     * output rows, expert e's from expert_first[e]); the shared expert's output rows; the
     * scratch of each of expert_threads threads that run experts side by side */
    float *logits, *route_w, *row_w, *expert_out, *rows_out;
    int64_t *route_ids, *rows, *expert_first;
    const tm_scratch *expert_scratch;
    int64_t expert_threads;
} tm_model;

static int reduce(const tm_model *m, float *x, int64_t n) {
    if (m->tp_size == 1) return 0;
    return (int)tm_shm_allreduce(m->shm_base, m->tp_rank, m->tp_size, m->slot_floats,
                                 m->shm_seq, x, n);
}

static void linear(const tm_scratch *m, const tm_linear *l, const float *x, float *y,
                   int64_t T) {
    switch (l->kind) {
        case TM_F32_PANEL:
            tm_f32_panel_gemm(x, l->w, l->bias, y, T, l->n, l->k, l->param);
            break;
        case TM_BF16_PANEL: /* (fails only without memory for x in bf16: nothing to go on) */
            if (tm_bf16_panel_gemm(x, l->w, l->bias, y, T, l->n, l->k, l->param)) abort();
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
        case TM_KQUANT: /* kquant_panels.c: the layer's panels are one blob */
            tm_quantize_rows_q8x2(x, (int8_t *)m->xq, m->xs, m->xsum, m->hsum, T, l->k);
            tm_kquant_gemm(l->param, (const int8_t *)m->xq, m->xs, m->xsum, m->hsum, l->w,
                           l->bias, y, T, l->n, l->k);
            break;
        case TM_PARTS: {
            const tm_linear *parts = (const tm_linear *)l->w;
            int64_t col = 0;
            for (int64_t p = 0; p < l->param; col += parts[p].n, p++) {
                if (T == 1) {
                    linear(m, parts + p, x, y + col, 1);
                    continue;
                }
                linear(m, parts + p, x, m->part_out, T);
                for (int64_t t = 0; t < T; t++)
                    memcpy(y + t * l->n + col, m->part_out + t * parts[p].n,
                           parts[p].n * sizeof(float));
            }
            break;
        }
        case TM_INT4:
            tm_int4_gemm(x, l->w, l->scale, l->min, l->bias, y, T, l->n, l->k, l->param);
            break;
        case TM_INT4_Q16:
            tm_quantize_rows_q16(x, m->xq, m->xs, m->xsum, T, l->k);
            tm_int4_gemm_q16(m->xq, m->xs, m->xsum, l->w, l->scale, l->min, l->bias, y, T,
                             l->n, l->k);
            break;
        default: /* a kind this file does not know: never leave y unwritten */
            abort();
    }
    const tm_lora *lora = l->lora;
    if (lora != NULL && m->lora_slots != NULL)
        tm_lora_add(x, y, T, l->k, l->n, lora->at, lora->bt, lora->ldb, lora->width,
                    lora->slices,
                    lora->offsets, lora->ranks, m->lora_slots, m->lora_tmp);
}

/* y = (silu(x @ Wgate) * (x @ Wup)) @ Wdown, the gate|up product fused where it can be */
static void mlp(const tm_scratch *m, const tm_linear *gate_up, const tm_linear *down,
                int64_t inter, const float *x, float *y, int64_t T) {
    const int adapted = gate_up->lora != NULL && m->lora_slots != NULL;
    const int fused =
        adapted ? 0 :
        gate_up->kind == TM_F32_PANEL
            ? tm_f32_panel_glu(x, gate_up->w, gate_up->bias, m->act, T, inter, gate_up->k,
                               gate_up->param) == 0
        : gate_up->kind == TM_BF16_PANEL
            ? tm_bf16_panel_glu(x, gate_up->w, gate_up->bias, m->act, T, inter, gate_up->k,
                                gate_up->param) == 0
            : 0;
    if (!fused) {
        linear(m, gate_up, x, m->gate_up, T);
        tm_silu_and_mul(m->gate_up, m->act, T, inter);
    }
    linear(m, down, m->act, y, T);
}

/* Each row's top_k experts and weights (see tm_moe) from the router's logits. */
static void route(const tm_model *m, const tm_moe *e, int64_t T) {
    const int64_t E = e->num_experts, K = e->top_k;
    for (int64_t t = 0; t < T; t++) {
        float *p = m->logits + t * E, top = p[0], sum = 0.0f, chosen = 0.0f;
        for (int64_t i = 1; i < E; i++) top = p[i] > top ? p[i] : top;
        for (int64_t i = 0; i < E; i++) sum += (p[i] = expf(p[i] - top));
        for (int64_t i = 0; i < E; i++) p[i] /= sum;
        int64_t *ids = m->route_ids + t * K;
        float *w = m->route_w + t * K;
        for (int64_t j = 0; j < K; j++) { /* the largest not yet taken; ties: lower index */
            int64_t best = -1;
            for (int64_t i = 0; i < E; i++) {
                int taken = 0;
                for (int64_t c = 0; c < j; c++) taken |= ids[c] == i;
                if (!taken && (best < 0 || p[i] > p[best])) best = i;
            }
            ids[j] = best;
            chosen += (w[j] = p[best]);
        }
        for (int64_t j = 0; j < K; j++) {
            if (e->renormalize) w[j] /= chosen;
            if (e->scaling != 1.0f) w[j] *= e->scaling;
        }
    }
}

/* out = the block's output for the normed rows x (this rank's partial sums). The active
 * experts run side by side, one thread each (their kernels then run on that thread alone:
 * a nested parallel region), into rows of their own; the weighted sums are then taken in
 * expert order, as the Python path adds them up. */
static void moe(const tm_model *m, const tm_moe *e, const float *x, float *out, int64_t T) {
    const int64_t H = m->hidden, K = e->top_k, E = e->num_experts;
    const tm_scratch *scratch = &m->scratch;
    int64_t *first = m->expert_first;
    linear(scratch, &e->router, x, m->logits, T);
    route(m, e, T);
    int64_t n = 0;
    for (int64_t ex = 0; ex < E; ex++) {
        first[ex] = n;
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < K; j++)
                if (m->route_ids[t * K + j] == ex) {
                    m->rows[n] = t;
                    m->row_w[n++] = m->route_w[t * K + j];
                }
    }
    first[E] = n;
    const int threads = (int)(m->expert_threads < omp_get_max_threads()
                              ? m->expert_threads : omp_get_max_threads());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t ex = 0; ex < E; ex++) {
        const int64_t count = first[ex + 1] - first[ex];
        if (!count || e->gate_up[ex].kind < 0) continue;
        const tm_scratch *s = m->expert_scratch + omp_get_thread_num();
        for (int64_t c = 0; c < count; c++)
            memcpy(s->rows_in + c * H, x + m->rows[first[ex] + c] * H, H * sizeof(float));
        mlp(s, &e->gate_up[ex], &e->down[ex], e->inter, s->rows_in,
            m->expert_out + first[ex] * H, count);
    }
    memset(out, 0, T * H * sizeof(float));
    for (int64_t ex = 0; ex < E; ex++) {
        if (e->gate_up[ex].kind < 0) continue;
        for (int64_t c = first[ex]; c < first[ex + 1]; c++) {
            float *dst = out + m->rows[c] * H;
            const float *src = m->expert_out + c * H, w = m->row_w[c];
            for (int64_t h = 0; h < H; h++) dst[h] += src[h] * w;
        }
    }
    if (e->shared_gate_up.kind < 0) return;
    mlp(scratch, &e->shared_gate_up, &e->shared_down, e->shared_inter, x, m->rows_out, T);
    for (int64_t t = 0; t < T; t++) {
        float g = 0.0f;
        if (e->shared_gate) {
            for (int64_t h = 0; h < H; h++) g += x[t * H + h] * e->shared_gate[h];
            g = 1.0f / (1.0f + expf(-g));
        }
        for (int64_t h = 0; h < H; h++) {
            const float shared = m->rows_out[t * H + h];
            out[t * H + h] += e->shared_gate ? g * shared : shared;
        }
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
    const tm_scratch *scratch = &m->scratch;
    for (int64_t i = 0; i < m->num_layers; i++) {
        const tm_layer *layer = m->layers + i;
        if (i == 0 && m->first_stage) {
            memcpy(m->residual, hidden, T * H * sizeof(float));
            tm_add_rms_norm(hidden, NULL, layer->input_norm, m->normed, T, H, m->eps);
        } else {
            tm_add_rms_norm(hidden, m->residual, layer->input_norm, m->normed, T, H, m->eps);
        }
        linear(scratch, &layer->qkv, m->normed, m->qkv, T);
        if (layer->q_norm) /* per head, in place: each row is read before it is written */
            for (int64_t t = 0; t < T; t++) {
                float *row = m->qkv + t * width;
                tm_add_rms_norm(row, NULL, layer->q_norm, row, hq, D, m->eps);
                tm_add_rms_norm(row + q_size, NULL, layer->k_norm, row + q_size, hkv, D,
                                m->eps);
            }
        tm_rotary(m->qkv, T, hq + hkv, D, width, m->cos, m->signed_sin, positions);
        tm_write_kv(m->qkv + q_size, m->qkv + q_size + kv_size, width, width, layer->k_cache,
                    layer->v_cache, slots, T, hkv, D, m->kv_kind);
        tm_paged_decode_attention(m->qkv, width, layer->k_cache, layer->v_cache, block_table,
                                  table_stride, seq_lens, m->attn, T, hq, hkv, D,
                                  m->block_size, m->scale, m->kv_kind, 0, NULL);
        linear(scratch, &layer->o, m->attn, hidden, T);
        if (reduce(m, hidden, T * H)) return -2;
        tm_add_rms_norm(hidden, m->residual, layer->post_norm, m->normed, T, H, m->eps);
        if (layer->moe)
            moe(m, layer->moe, m->normed, hidden, T);
        else
            mlp(scratch, &layer->gate_up, &layer->down, m->intermediate, m->normed, hidden, T);
        if (reduce(m, hidden, T * H)) return -2;
    }
    if (m->last_stage) tm_add_rms_norm(hidden, m->residual, m->final_norm, out, T, H, m->eps);
    return 0;
}
