/* A CPU linear on GGUF Q6_K blocks as the file stores them, with 8-bit activations (specexec.formats.q6k).

   A block holds 256 values in 210 bytes: ql[128] (the low 4 bits), qh[64] (the high 2 bits), 16 int8 sub-scales
   (one per 16 values, in order), fp16 d. Value i of half h (128 values) at position p = 32 g + l (g < 4, l < 32):
   low nibble of ql[64 h + l + 32 (g & 1)] for g < 2, its high nibble for g >= 2; high bits (qh[32 h + l] >> 2 g) & 3;
   q = low | high << 4 in 0..63; the value is d * sc[8 h + p / 16] * (q - 32).
   Activations: each row quantized by blocks of 256 to int8 with one fp32 scale (absmax / 127), plus the int16 sum
   of every 16 values.

   A block's product is one exact integer, the scheme of llama.cpp's Q6_K x Q8_K dot product: isum = sum over the
   16 sub-blocks of sc * (q . a) - 32 * sc * (the sub-block's activation sum). An output element is then
   acc += (d * xd) * isum over the blocks in order, fp32 multiplies and adds: every path (scalar, AVX2, AVX-512 with
   8 rows sharing each unpacked block) computes exactly that, so a row's result never depends on the pass it is in, its row count or the threads. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QB 256 /* values a block */
#define BB 210 /* bytes a block */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define WIDE6 1 /* groups of 8 rows take 64 values a register (wide6_rows) */
#define RT6 8   /* activation rows sharing one unpacked weight block */
#else
#define RT6 4
#endif
#define OT6 16 /* weight rows a thread takes past every group of rows */
#define PF6 1680 /* bytes of a weight row prefetched ahead (8 blocks) */

float q4_h2f(uint16_t h);

/* Row r of x (rows, k) -> int8 values qa (rows, k), block scales dx (block s of row r at s * rp + r), sums of 16
   bs (rows, k / 16). */
static void q8k_row(const float *x, int64_t r, int64_t k, int8_t *qa, float *dx, int64_t rp, int16_t *bs) {
    const int64_t nb = k / QB;
    for (int64_t s = 0; s < nb; s++) {
        const float *v = x + r * k + s * QB;
        float amax = 0.f;
        for (int j = 0; j < QB; j++) { float a = fabsf(v[j]); if (a > amax) amax = a; }
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < QB / 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) {
                const int q = (int)nearbyintf(v[j * 16 + i] * id);
                qa[r * k + s * QB + j * 16 + i] = (int8_t)q;
                sum += q;
            }
            bs[r * (k / 16) + s * 16 + j] = (int16_t)sum;
        }
        dx[s * rp + r] = d;
    }
}

/* sum over the 16 sub-blocks of sc * (the activation sum): exact in any order */
static inline int32_t q6_imin(const int8_t *sc, const int16_t *b) {
    int32_t m = 0;
    for (int j = 0; j < 16; j++) m += (int32_t)sc[j] * b[j];
    return m;
}

#ifdef __AVX2__
static inline int32_t hsum256(__m256i v) { /* integer sums: exact in any order */
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* A block's header: the row's stream prefetched PF6 bytes ahead, its fp16 scale d; returns its sub-scales. */
static inline __attribute__((always_inline)) const int8_t *q6_head(const uint8_t *blk, float *d) {
    _mm_prefetch((const char *)(blk + PF6), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + PF6 + 64), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + PF6 + 128), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + PF6 + 192), _MM_HINT_T0);
    uint16_t hd;
    memcpy(&hd, blk + 208, 2);
    *d = q4_h2f(hd);
    return (const int8_t *)(blk + 192);
}

/* lane r: the sum of the 8 lanes of v[r] (r < 4) */
static inline __m128i sums4(const __m256i *v) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
}

/* Rows 0 .. R - 1 (of qa and bs at row strides k and k / 16; dx: block s of row r at s * rp + r) against one
   weight row; R constant once inlined. */
static inline __attribute__((always_inline)) void q6_rows(const uint8_t *wr, int64_t nb, int64_t k, const int8_t *qa,
                                                          const float *dx, int64_t rp, const int16_t *bs, const int R,
                                                          float *res, int64_t ldo) {
    float acc1 = 0.f;
    __m128 acc = _mm_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
    for (int64_t s = 0; s < nb; s++) {
        const uint8_t *blk = wr + s * BB;
        float d;
        const int8_t *sc = q6_head(blk, &d);
        /* -32 sc times the activation sums, started in the integer sum: madd pairs sub-blocks 2i, 2i + 1 */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i isum[RT6];
        for (int r = 0; r < R; r++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(bs + r * (k / 16) + s * 16));
            isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, b), 5));
        }
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
            for (int g = 0; g < 4; g++) {
                /* int16 lanes 0-7 hold values 0-15 of the 32 (sub-scale 2g), lanes 8-15 values 16-31 (2g + 1) */
                const int j = 8 * h + 2 * g;
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[j + 1]), _mm_set1_epi16(sc[j]));
                for (int r = 0; r < R; r++) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(qa + r * k + s * QB + 128 * h + 32 * g));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], a), scv));
                }
            }
        }
        if (R == 1) {
            acc1 += d * dx[s * rp] * (float)hsum256(isum[0]);
        } else { /* the rows' totals, then the float step for all of them at once (lane r: row r) */
            for (int r = R; r < RT6; r++) isum[r] = _mm256_setzero_si256();
            const __m128 xd = _mm_loadu_ps(dx + s * rp);
            acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(d), xd), _mm_cvtepi32_ps(sums4(isum))));
        }
    }
    if (R == 1) { res[0] = acc1; return; }
    float out[RT6];
    _mm_storeu_ps(out, acc);
    for (int r = 0; r < R; r++) res[r * ldo] = out[r];
}
#endif

#ifdef WIDE6
/* lane r (r < 8): the sum of the 16 lanes of v[r] */
static inline __m256i sums8(const __m512i *v) {
    __m256i y[8];
    for (int r = 0; r < 8; r++) y[r] = _mm256_add_epi32(_mm512_castsi512_si256(v[r]), _mm512_extracti64x4_epi64(v[r], 1));
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(y[0], y[1]), _mm256_hadd_epi32(y[2], y[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(y[4], y[5]), _mm256_hadd_epi32(y[6], y[7]));
    /* a: rows 0-3 in each 128-bit half, b: rows 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* q6_rows for up to 8 rows with 512-bit registers: a register holds 64 values (4 sub-blocks); u8 x s8 pairs summed
   to int16 (maddubs), times the sub-scales and summed into int32 lanes (madd). */
static inline __attribute__((always_inline)) void wide6_rows(const uint8_t *wr, int64_t nb, int64_t k,
                                                             const int8_t *qa, const float *dx, int64_t rp,
                                                             const int16_t *bs, const int R, float *res, int64_t ldo) {
    float acc1 = 0.f;
    __m256 acc = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03);
    /* the high bits of values 0-31 sit at shift 0 of qh, of 32-63 at shift 2 (and 4, 6 for 64-95, 96-127) */
    const __m512i shA = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i shB = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    /* int16 lane i of a product covers values 2i, 2i + 1: sub-block i / 8 of the register's 4 */
    const __m512i pick = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0,
                                          0, 0, 0, 0, 0, 0);
    const __m512i four = _mm512_set1_epi16(4);
    for (int64_t s = 0; s < nb; s++) {
        const uint8_t *blk = wr + s * BB;
        float d;
        const int8_t *sc = q6_head(blk, &d);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        const __m512i scw = _mm512_castsi256_si512(sc16);
        __m512i isum[8];
        for (int r = 0; r < R; r++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(bs + r * (k / 16) + s * 16));
            const __m256i m = _mm256_slli_epi32(_mm256_madd_epi16(sc16, b), 5);
            isum[r] = _mm512_castsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), m));
            isum[r] = _mm512_inserti64x4(isum[r], _mm256_setzero_si256(), 1);
        }
        __m512i idx = pick;
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
            const __m512i qa_ = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shA), m2), 4));
            const __m512i qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shB), m2), 4));
            const __m512i sa = _mm512_permutexvar_epi16(idx, scw);
            idx = _mm512_add_epi16(idx, four);
            const __m512i sb = _mm512_permutexvar_epi16(idx, scw);
            idx = _mm512_add_epi16(idx, four);
            for (int r = 0; r < R; r++) {
                const int8_t *a = qa + r * k + s * QB + 128 * h;
                const __m512i pa = _mm512_madd_epi16(_mm512_maddubs_epi16(qa_, _mm512_loadu_si512((const void *)a)), sa);
                const __m512i pb = _mm512_madd_epi16(_mm512_maddubs_epi16(qb, _mm512_loadu_si512((const void *)(a + 64))), sb);
                isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(pa, pb));
            }
        }
        if (R == 1) {
            acc1 += d * dx[s * rp] * (float)_mm512_reduce_add_epi32(isum[0]);
            continue;
        }
        for (int r = R; r < 8; r++) isum[r] = _mm512_setzero_si512();
        const __m256 xd = _mm256_loadu_ps(dx + s * rp);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), xd), _mm256_cvtepi32_ps(sums8(isum))));
    }
    if (R == 1) { res[0] = acc1; return; }
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int r = 0; r < R; r++) res[r * ldo] = out[r];
}
#endif

/* one row against one weight row, in plain C: the same integers and the same float steps */
static void q6_row_scalar(const uint8_t *wr, int64_t nb, const int8_t *qa, const float *dx, int64_t rp,
                          const int16_t *bs, float *res) {
    float acc = 0.f;
    for (int64_t s = 0; s < nb; s++) {
        const uint8_t *blk = wr + s * BB, *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192), *a = qa + s * QB;
        uint16_t hd;
        memcpy(&hd, blk + 208, 2);
        int32_t tot = 0;
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t lb = ql[64 * h + l + 32 * (g & 1)];
                    const int q = ((g < 2 ? lb : lb >> 4) & 15) | (((qh[32 * h + l] >> (2 * g)) & 3) << 4);
                    const int p = 128 * h + 32 * g + l;
                    tot += (int32_t)sc[p / 16] * q * a[p];
                }
        tot -= 32 * q6_imin(sc, bs + s * 16);
        acc += q4_h2f(hd) * dx[s * rp] * (float)tot;
    }
    *res = acc;
}

/* out (rows, ldo; columns [0, n)) = x (rows, k) fp32 times dequant(w) (n, k) transposed, w: n rows of k / 256
   Q6_K blocks. Returns 0, or -1 when the scratch memory cannot be had. */
int q6k_matmul(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *out, int64_t ldo) {
    const int64_t nb = k / QB, rp = (rows + RT6 - 1) / RT6 * RT6;
    int8_t *qa = (int8_t *)malloc((size_t)(rows * k));
    float *dx = (float *)calloc((size_t)(rp * nb), sizeof(float));
    int16_t *bs = (int16_t *)malloc(sizeof(int16_t) * (size_t)(rows * (k / 16)));
    if (!qa || !dx || !bs) { free(qa); free(dx); free(bs); return -1; }
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) q8k_row(x, r, k, qa, dx, rp, bs);
        #pragma omp for schedule(static)
        for (int64_t ot = 0; ot < n; ot += OT6)
            for (int64_t r0 = 0; r0 < rows; r0 += RT6) {
                const int rt = rows - r0 < RT6 ? (int)(rows - r0) : RT6;
                const int8_t *q = qa + r0 * k;
                const float *dd = dx + r0;
                const int16_t *b = bs + r0 * (k / 16);
                for (int64_t o = ot; o < n && o < ot + OT6; o++) {
                    const uint8_t *wr = w + o * nb * BB;
                    float *res = out + r0 * ldo + o;
#ifdef WIDE6
                    switch (rt) {
                        case 1: wide6_rows(wr, nb, k, q, dd, rp, b, 1, res, ldo); break;
                        case 2: wide6_rows(wr, nb, k, q, dd, rp, b, 2, res, ldo); break;
                        case 3: wide6_rows(wr, nb, k, q, dd, rp, b, 3, res, ldo); break;
                        case 4: wide6_rows(wr, nb, k, q, dd, rp, b, 4, res, ldo); break;
                        case 5: wide6_rows(wr, nb, k, q, dd, rp, b, 5, res, ldo); break;
                        case 6: wide6_rows(wr, nb, k, q, dd, rp, b, 6, res, ldo); break;
                        case 7: wide6_rows(wr, nb, k, q, dd, rp, b, 7, res, ldo); break;
                        default: wide6_rows(wr, nb, k, q, dd, rp, b, 8, res, ldo); break;
                    }
#elif defined(__AVX2__)
                    switch (rt) {
                        case 1: q6_rows(wr, nb, k, q, dd, rp, b, 1, res, ldo); break;
                        case 2: q6_rows(wr, nb, k, q, dd, rp, b, 2, res, ldo); break;
                        case 3: q6_rows(wr, nb, k, q, dd, rp, b, 3, res, ldo); break;
                        default: q6_rows(wr, nb, k, q, dd, rp, b, 4, res, ldo); break;
                    }
#else
                    for (int r = 0; r < rt; r++)
                        q6_row_scalar(wr, nb, q + r * k, dd + r, rp, b + r * (k / 16), res + r * ldo);
#endif
                }
            }
    }
    free(qa);
    free(dx);
    free(bs);
    return 0;
}

/* The scalar path, for tests on machines whose compiler takes the vector one: the same function of the same
   integers. */
int q6k_matmul_scalar(const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t rows, float *out) {
    const int64_t nb = k / QB;
    int8_t *qa = (int8_t *)malloc((size_t)(rows * k));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(rows * nb));
    int16_t *bs = (int16_t *)malloc(sizeof(int16_t) * (size_t)(rows * (k / 16)));
    if (!qa || !dx || !bs) { free(qa); free(dx); free(bs); return -1; }
    for (int64_t r = 0; r < rows; r++) q8k_row(x, r, k, qa, dx, rows, bs);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < n; o++)
            q6_row_scalar(w + o * nb * BB, nb, qa + r * k, dx + r, rows, bs + r * (k / 16), out + r * n + o);
    free(qa);
    free(dx);
    free(bs);
    return 0;
}
