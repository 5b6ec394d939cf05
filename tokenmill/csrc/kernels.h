/* The kernels of this folder that other kernels call (decode_step.c runs whole decoder layers
 * with them); the Python side declares the same signatures in csrc/__init__.py. */
#pragma once
#include <stdint.h>

void tm_int8_gemm(const float *x, const int8_t *w, const float *scale, const float *bias,
                  float *y, int64_t M, int64_t N, int64_t K, int64_t group);
void tm_int4_gemm(const float *x, const uint8_t *w, const uint16_t *scale,
                  const uint16_t *min, const float *bias, float *y, int64_t M, int64_t N,
                  int64_t K, int64_t group);
void tm_quantize_rows_q16(const float *x, int16_t *xq, float *xs, float *xsum, int64_t M,
                          int64_t K);
void tm_int8_gemm_q16(const int16_t *xq, const float *xs, const int8_t *w, const float *scale,
                      const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                      int64_t group);
void tm_int4_gemm_q16(const int16_t *xq, const float *xs, const float *xsum, const uint8_t *w,
                      const uint16_t *scale, const uint16_t *min, const float *bias, float *y,
                      int64_t M, int64_t N, int64_t K);
void tm_f32_panel_gemm(const float *x, const float *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int64_t KP);
int64_t tm_f32_panel_glu(const float *x, const float *w, const float *bias, float *act,
                         int64_t M, int64_t I, int64_t K, int64_t KP);
void tm_int8_to_panels(const int8_t *w, const float *scale, int64_t N, int64_t K,
                       int64_t group, float *out);
void tm_int4_to_panels(const uint8_t *w, const uint16_t *scale, const uint16_t *min,
                       int64_t N, int64_t K, int64_t group, float *out);
void tm_int8_to_vnni(const int8_t *w, const float *scale, int64_t N, int64_t K,
                     int64_t group, int8_t *wp, float *sp);
void tm_int4_to_vnni(const uint8_t *w, const uint16_t *scale, const uint16_t *min, int64_t N,
                     int64_t K, int64_t group, uint8_t *wp, uint16_t *sp, uint16_t *mp);
int64_t tm_vnni_native(void);
void tm_int8_vnni_gemm(const int16_t *xq, const float *xs, const int8_t *wp, const float *sp,
                       const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t group);
void tm_int4_vnni_gemm(const int16_t *xq, const float *xs, const float *xsum, const uint8_t *wp,
                       const uint16_t *sp, const uint16_t *mp, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int64_t group);
void tm_fp4_vnni_gemm(const int16_t *xq, const float *xs, const uint8_t *wp,
                      const uint16_t *sp, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K);
void tm_fp4_experts(const float *x, int64_t M, int64_t H, int64_t I, int64_t top_k,
                    const int64_t *ids, const float *weights, int64_t E, const int64_t *parts,
                    float alpha, float limit, float *out);
int64_t tm_kquant_panel_bytes(int64_t K, int64_t kind);
void tm_quantize_rows_q8x2(const float *x, int8_t *xq, float *xs, float *xsum, int32_t *hsum,
                           int64_t M, int64_t K);
void tm_kquant_gemm(int64_t kind, const int8_t *xq, const float *xs, const float *xsum,
                    const int32_t *hsum, const uint8_t *blob, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K);
void tm_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache, const int64_t *block_table,
                               int64_t table_stride, const int64_t *seq_lens, float *out,
                               int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                               int64_t block_size, float scale, int64_t kv_kind,
                               int64_t window, const float *sinks);
void tm_add_rms_norm(float *x, float *residual, const float *weight, float *out, int64_t T,
                     int64_t D, float eps);
void tm_rotary(float *x, int64_t T, int64_t H, int64_t D, int64_t stride, const float *cos,
               const float *signed_sin, const int64_t *positions);
void tm_silu_and_mul(const float *x, float *out, int64_t T, int64_t I);
void tm_write_kv(const float *k, const float *v, int64_t k_stride, int64_t v_stride,
                 void *k_cache, void *v_cache, const int64_t *slots, int64_t T, int64_t H,
                 int64_t D, int64_t kv_kind);
int64_t tm_shm_allreduce(char *base, int64_t rank, int64_t size, int64_t slot_floats,
                         int64_t *seq, float *x, int64_t n);
void tm_bf16_to_panels(const uint16_t *w, int64_t N, int64_t K, int64_t KP, uint16_t *out);
int64_t tm_bf16_panel_gemm(const float *x, const uint16_t *w, const float *bias, float *y,
                           int64_t M, int64_t N, int64_t K, int64_t KP);
int64_t tm_bf16_panel_glu(const float *x, const uint16_t *w, const float *bias, float *act,
                          int64_t M, int64_t I, int64_t K, int64_t KP);
void tm_lora_add(const float *x, float *y, int64_t T, int64_t K, int64_t N, const float *at,
                 const float *bt, int64_t ldb, int64_t width, int64_t slices,
                 const int64_t *offsets, const int64_t *ranks, const int64_t *slots, float *tmp);
