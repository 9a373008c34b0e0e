/* A whole pass of decoder layers with 4-bit weights on a CPU, in one call (specexec.formats.layers).

   Per layer: RMSNorm, the fused q/k/v product (+ bias), rotate-half RoPE on queries and keys, the keys and values
   written into the cache at the pass's slots, attention (attn_rows, attn.c), the output product added to the
   residual, RMSNorm, the fused gate/up product, silu(gate) * up, the down product added to the residual. The
   products are block_matmul (q4.c and q6k.c over a weight's parts). A pass of a small model spends as much time
   between its products (a dozen torch operations per layer, each a Python call) as in them; here they cost
   nothing. Every row's arithmetic is a fixed
   sequence of fp32 operations that depends only on that row (the products and attention are row-invariant too),
   so a row's result is the same in any pass. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int q4_matmul_ld(const uint8_t *w, int64_t n, int64_t k, int ns, const float *x, int64_t rows, float *out,
                 int64_t ldo);
int q6k_matmul(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *out, int64_t ldo);
void attn_rows(const float *q, int64_t P, int64_t H, int64_t KVH, int64_t hd, const void *keys, const void *values,
               int is_bf16, int64_t head_stride, const int64_t *idx, const int64_t *start, float scale, float cap,
               float *out);

#define LANES 8

/* out = w * (x * 1 / sqrt(mean(x^2) + eps)), each row's squares summed in 8 lanes, then the lanes in order */
static void rms_rows(const float *x, const float *w, int64_t T, int64_t D, float eps, float *out) {
    #pragma omp parallel for schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *v = x + t * D;
        float acc[LANES] = {0};
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += v[d + l] * v[d + l];
        for (int l = 0; d < D; d++, l++) acc[l] += v[d] * v[d];
        float ss = 0.f;
        for (int l = 0; l < LANES; l++) ss += acc[l];
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        float *o = out + t * D;
        for (d = 0; d < D; d++) o[d] = w[d] * (v[d] * r);
    }
}

/* out (rows, n) = x (rows, k) times a weight made of parts whose outputs sit side by side. t: the number of parts,
   then per part its packed rows' address, its rows, its type (0: q4 with t[4] sub-blocks a super-block, 1: Q6_K)
   and that count (specexec.formats.blocks.table). Returns 0, or -1 when a product's scratch memory cannot be
   had. */
int block_matmul(const int64_t *t, int64_t k, const float *x, int64_t rows, float *out) {
    int64_t n = 0, col = 0;
    for (int64_t p = 0; p < t[0]; p++) n += t[2 + 4 * p];
    for (int64_t p = 0; p < t[0]; p++) {
        const int64_t *e = t + 1 + 4 * p;
        const uint8_t *w = (const uint8_t *)(intptr_t)e[0];
        const int rc = e[2] ? q6k_matmul(w, e[1], k, x, rows, out + col, n)
                            : q4_matmul_ld(w, e[1], k, (int)e[3], x, rows, out + col, n);
        if (rc) return -1;
        col += e[1];
    }
    return 0;
}

/* Layer weights, per layer, as addresses: attention norm, q/k/v, q/k/v bias (0: none), output, MLP norm, gate/up,
   down; the four products' addresses are their block_matmul tables. */
enum { W_ANORM, W_QKV, W_BQKV, W_O, W_MNORM, W_13, W_2, W_N };

/* x (T, D) fp32, updated in place by layers [0, L). cos, sin (T, hd): RoPE tables (sin with its first half
   negated). Cache: layer i's keys at kc + i * layer_stride, element [g, slot, d] at g * head_stride + slot * hd + d
   (fp32; the same for values); row t writes slot slots[t]. Row t attends to idx[start[t] .. start[t + 1]).
   Returns 0, or -1 when scratch memory or a product's could not be allocated. */
int q4_layers(int64_t L, int64_t T, int64_t D, int64_t H, int64_t KVH, int64_t hd, int64_t F, float *x,
              const int64_t *ptrs, const float *cos, const float *sin, float *kc, float *vc,
              int64_t layer_stride, int64_t head_stride, const int64_t *slots, const int64_t *idx,
              const int64_t *start, float scale, float eps) {
    const int64_t nq = H * hd, nkv = KVH * hd, nqkv = nq + 2 * nkv, half = hd / 2;
    const int64_t wide = nqkv > 2 * F ? nqkv : 2 * F;
    float *h = (float *)malloc(sizeof(float) * (size_t)(T * (D > F ? D : F)));
    float *big = (float *)malloc(sizeof(float) * (size_t)(T * wide));
    float *q = (float *)malloc(sizeof(float) * (size_t)(T * nq));
    float *att = (float *)malloc(sizeof(float) * (size_t)(T * nq));
    float *y = (float *)malloc(sizeof(float) * (size_t)(T * D));
    int failed = !h || !big || !q || !att || !y;
    for (int64_t i = 0; i < L && !failed; i++) {
        const int64_t *p = ptrs + i * W_N;
        rms_rows(x, (const float *)(intptr_t)p[W_ANORM], T, D, eps, h);
        if (block_matmul((const int64_t *)(intptr_t)p[W_QKV], D, h, T, big)) { failed = 1; break; }
        const float *bias = (const float *)(intptr_t)p[W_BQKV];
        float *kl = kc + i * layer_stride, *vl = vc + i * layer_stride;
        #pragma omp parallel for schedule(static) if (T > 4)
        for (int64_t t = 0; t < T; t++) {
            float *r = big + t * nqkv;
            if (bias)
                for (int64_t j = 0; j < nqkv; j++) r[j] = r[j] + bias[j];
            const float *c = cos + t * hd, *s = sin + t * hd;
            for (int64_t head = 0; head < H + KVH; head++) { /* x * cos + swap_halves(x) * sin, in place */
                float *v = r + head * hd;
                float lo[512];
                for (int64_t d = 0; d < half; d++) lo[d] = v[d];
                for (int64_t d = 0; d < half; d++) v[d] = v[d] * c[d] + v[d + half] * s[d];
                for (int64_t d = half; d < hd; d++) v[d] = v[d] * c[d] + lo[d - half] * s[d];
            }
            memcpy(q + t * nq, r, sizeof(float) * (size_t)nq);
            for (int64_t g = 0; g < KVH; g++) {
                memcpy(kl + g * head_stride + slots[t] * hd, r + nq + g * hd, sizeof(float) * (size_t)hd);
                memcpy(vl + g * head_stride + slots[t] * hd, r + nq + nkv + g * hd, sizeof(float) * (size_t)hd);
            }
        }
        attn_rows(q, T, H, KVH, hd, kl, vl, 0, head_stride, idx, start, scale, 0.f, att);
        if (block_matmul((const int64_t *)(intptr_t)p[W_O], nq, att, T, y)) { failed = 1; break; }
        for (int64_t j = 0; j < T * D; j++) x[j] = x[j] + y[j];
        rms_rows(x, (const float *)(intptr_t)p[W_MNORM], T, D, eps, h);
        if (block_matmul((const int64_t *)(intptr_t)p[W_13], D, h, T, big)) { failed = 1; break; }
        #pragma omp parallel for schedule(static) if (T > 4)
        for (int64_t t = 0; t < T; t++) {
            const float *gu = big + t * 2 * F;
            float *m = h + t * F;
            for (int64_t f = 0; f < F; f++) {
                const float g = gu[f];
                m[f] = g / (1.f + expf(-g)) * gu[F + f];
            }
        }
        if (block_matmul((const int64_t *)(intptr_t)p[W_2], F, h, T, y)) { failed = 1; break; }
        for (int64_t j = 0; j < T * D; j++) x[j] = x[j] + y[j];
    }
    free(h);
    free(big);
    free(q);
    free(att);
    free(y);
    return failed ? -1 : 0;
}
