/* Attention of a pass's rows on a CPU, each row over its own keys in position order (specexec.model.attention).

   Every (row, head) is one thread's fixed sequence of operations over the keys the row sees, in the order given:
   scores in 8 lanes then summed in a fixed order, the maximum, exponentials, their sum in key order, and the
   values weighted in key order. A row's result therefore depends only on its query and the keys and values it
   sees, never on the pass it is in, the other rows or the thread count. Keys and values are fp32 or bf16; the
   arithmetic is fp32. Built with the package's other CPU kernels (-O3 -march=native -ffp-contract=off, no
   -ffast-math: the compiler vectorizes the lanes without reordering a sum). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

static inline float bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* one key or value row as fp32 (bf16 rows converted into dst) */
static inline const float *load_row(const void *base, int64_t off, int64_t hd, int is_bf16, float *dst) {
    if (!is_bf16) return (const float *)base + off;
    const uint16_t *p = (const uint16_t *)base + off;
    for (int64_t d = 0; d < hd; d++) dst[d] = bf16(p[d]);
    return dst;
}

static inline float dot(const float *a, const float *b, int64_t hd) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= hd; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[d + l] * b[d + l];
    for (int l = 0; d < hd; d++, l++) acc[l] += a[d] * b[d];
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

/* q (P, H, hd) fp32; keys/values: element [g, slot, d] at g * head_stride + slot * hd + d (fp32 or bf16);
   row r sees the slots idx[start[r] .. start[r + 1]) in position order (at least one); out (P, H, hd) fp32.
   cap > 0: scores soft-capped, cap * tanh(score / cap). */
void attn_rows(const float *q, int64_t P, int64_t H, int64_t KVH, int64_t hd, const void *keys, const void *values,
               int is_bf16, int64_t head_stride, const int64_t *idx, const int64_t *start, float scale, float cap,
               float *out) {
    const int64_t G = H / KVH;
    #pragma omp parallel
    {
        int64_t most = 0;
        for (int64_t r = 0; r < P; r++) if (start[r + 1] - start[r] > most) most = start[r + 1] - start[r];
        float *s = (float *)malloc(sizeof(float) * (size_t)(most > 0 ? most : 1));
        float *row = (float *)malloc(sizeof(float) * (size_t)hd);
        float *acc = (float *)malloc(sizeof(float) * (size_t)hd);
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < P * H; task++) {
            const int64_t r = task / H, h = task % H, g = h / G;
            const int64_t n = start[r + 1] - start[r];
            const int64_t *ids = idx + start[r];
            const float *qv = q + task * hd;
            float m = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                float x = dot(qv, load_row(keys, g * head_stride + ids[j] * hd, hd, is_bf16, row), hd) * scale;
                if (cap > 0.f) x = cap * tanhf(x / cap);
                s[j] = x;
                if (x > m) m = x;
            }
            float sum = 0.f;
            for (int64_t j = 0; j < n; j++) {
                s[j] = expf(s[j] - m);
                sum += s[j];
            }
            for (int64_t d = 0; d < hd; d++) acc[d] = 0.f;
            for (int64_t j = 0; j < n; j++) {
                const float *v = load_row(values, g * head_stride + ids[j] * hd, hd, is_bf16, row);
                const float e = s[j];
                for (int64_t d = 0; d < hd; d++) acc[d] += e * v[d];
            }
            float *o = out + task * hd;
            for (int64_t d = 0; d < hd; d++) o[d] = acc[d] / sum;
        }
        free(s);
        free(row);
        free(acc);
    }
}
