/* A CPU linear with 4-bit weights and 8-bit activations (specexec.formats.q4).

   Weights: blocks of 32 values along a row, 20 bytes each: fp16 scale d, fp16 minimum m, then 16 bytes whose
   low nibbles hold values 0..15 of the block and high nibbles values 16..31; a value is d * q + m, q in 0..15.
   Activations: each row quantized by blocks of 32 to int8 with an fp32 scale (absmax / 127).

   Every output element is computed by one thread in one fixed sequence of operations, whatever the number of
   rows, outputs or threads: a row's result never depends on the pass it is in. Built by the package at first use
   with the system C compiler for this CPU (-march=native), without -ffast-math and with -ffp-contract=off. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32
#define BLOCK_BYTES 20 /* uint16 d, uint16 m (fp16), 16 bytes: value j in byte j's low nibble, j + 16 in its high */

static inline float h2f(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, f = h & 0x3ff, bits;
    if (e == 0) {
        if (f == 0) bits = s;
        else { e = 127 - 14; while (!(f & 0x400)) { f <<= 1; e--; } f &= 0x3ff; bits = s | (e << 23) | (f << 13); }
    } else if (e == 31) bits = s | 0x7f800000 | (f << 13);
    else bits = s | ((e + 112) << 23) | (f << 13);
    float out; memcpy(&out, &bits, 4); return out;
#endif
}

/* x (rows, k) fp32 -> qa (rows, k) int8, da (rows, k/32) scale, sa (rows, k/32) = da * sum(qa). */
void q8_rows(const float *x, int64_t rows, int64_t k, int8_t *qa, float *da, float *sa) {
    int64_t nb = k / QK;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QK;
            float amax = 0.f;
            for (int j = 0; j < QK; j++) { float a = fabsf(v[j]); if (a > amax) amax = a; }
            float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                int q = (int)nearbyintf(v[j] * id);
                qa[r * k + b * QK + j] = (int8_t)q;
                sum += q;
            }
            da[r * nb + b] = d;
            sa[r * nb + b] = d * (float)sum;
        }
    }
}

#define RT 4 /* activation rows sharing one unpacked weight block */

#ifdef __AVX2__
/* Rows r0 .. r0 + R - 1 against one weight row; R is a constant once inlined, so the accumulators live in
   registers. Blocks alternate between two accumulator chains (even, odd) to halve the add latency. */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *wr, int64_t nb, int64_t k,
                                                           const int8_t *qa, const float *da, const float *sa,
                                                           const int R, float *res, int64_t stride) {
    __m256 acc0[RT], acc1[RT];
    float min0[RT], min1[RT];
    for (int r = 0; r < R; r++) { acc0[r] = acc1[r] = _mm256_setzero_ps(); min0[r] = min1[r] = 0.f; }
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
#define Q4_BLOCK(b, ACC, MIN)                                                                                     \
    do {                                                                                                          \
        const uint8_t *blk = wr + (b) * BLOCK_BYTES;                                                              \
        uint16_t hd, hm;                                                                                          \
        memcpy(&hd, blk, 2);                                                                                      \
        memcpy(&hm, blk + 2, 2);                                                                                  \
        const float d = h2f(hd), m = h2f(hm);                                                                     \
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));                                          \
        const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low)); \
        for (int r = 0; r < R; r++) {                                                                             \
            const __m256i a = _mm256_loadu_si256((const __m256i *)(qa + r * k + (b) * QK));                       \
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, a), ones);                               \
            ACC[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * da[r * nb + (b)]), _mm256_cvtepi32_ps(p), ACC[r]);        \
            MIN[r] += m * sa[r * nb + (b)];                                                                       \
        }                                                                                                         \
    } while (0)
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        Q4_BLOCK(b, acc0, min0);
        Q4_BLOCK(b + 1, acc1, min1);
    }
    if (b < nb) Q4_BLOCK(b, acc0, min0);
#undef Q4_BLOCK
    for (int r = 0; r < R; r++) {
        __m256 a = _mm256_add_ps(acc0[r], acc1[r]);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        res[r * stride] = _mm_cvtss_f32(s) + (min0[r] + min1[r]);
    }
}
#endif

/* out (rows, n) = dequant(w) (n, k) applied to the quantized rows; every output element is one thread's fixed
   sequence of operations, whatever rows, n or the thread count. */
void q4_linear(const uint8_t *w, int64_t n, int64_t k, const int8_t *qa, const float *da, const float *sa,
               int64_t rows, float *out) {
    int64_t nb = k / QK;
    #pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *wr = w + o * nb * BLOCK_BYTES;
        for (int64_t r0 = 0; r0 < rows; r0 += RT) {
            int rt = rows - r0 < RT ? (int)(rows - r0) : RT;
#ifdef __AVX2__
            const int8_t *q = qa + r0 * k;
            const float *d = da + r0 * nb, *s = sa + r0 * nb;
            float *res = out + r0 * n + o;
            switch (rt) {
                case 1: dot_rows(wr, nb, k, q, d, s, 1, res, n); break;
                case 2: dot_rows(wr, nb, k, q, d, s, 2, res, n); break;
                case 3: dot_rows(wr, nb, k, q, d, s, 3, res, n); break;
                default: dot_rows(wr, nb, k, q, d, s, 4, res, n); break;
            }
#else
            for (int r = 0; r < rt; r++) {
                int64_t row = r0 + r;
                float acc = 0.f, mins = 0.f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *blk = wr + b * BLOCK_BYTES;
                    uint16_t hd, hm;
                    memcpy(&hd, blk, 2); memcpy(&hm, blk + 2, 2);
                    const int8_t *a = qa + row * k + b * QK;
                    int sum = 0;
                    for (int j = 0; j < 16; j++) sum += (blk[4 + j] & 15) * a[j] + (blk[4 + j] >> 4) * a[j + 16];
                    acc += h2f(hd) * da[row * nb + b] * (float)sum;
                    mins += h2f(hm) * sa[row * nb + b];
                }
                out[row * n + o] = acc + mins;
            }
#endif
        }
    }
}
