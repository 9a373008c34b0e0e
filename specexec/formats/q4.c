/* A CPU linear with 4-bit weights and 8-bit activations (specexec.formats.q4).

   Weights: super-blocks of SB = 32 * NS values along a row (NS = 1, 2, 4 or 8 sub-blocks of 32), 4 + 18 * NS bytes
   each: fp16 d, fp16 dmin, NS uint8 sub-scales, NS int8 sub-minimums, then 16 * NS bytes of nibbles. Sub-blocks
   2p and 2p + 1 share 32 bytes (byte i: value i of 2p in its low nibble, of 2p + 1 in its high); a lone sub-block
   (NS = 1) has 16 bytes (byte i: value i low, value i + 16 high). A value is d * sc * q + dmin * mn, q in 0..15.
   Activations: each row quantized by super-blocks to int8 with one fp32 scale (absmax / 127), plus the int16 sum
   of every sub-block of 32.

   A super-block's products stay in integers, the scheme of llama.cpp's Q4_K x Q8_K dot product: isum, the sum of
   the sub-scales times the 4 x 8-bit dot products, and imin, the sub-minimums times the activation sums, both
   exact whatever the order they are summed in. An output element is then defined by those integers alone:
   acc += (d * xd) * isum and macc += (dmin * xd) * imin over the super-blocks in order, separate fp32 multiplies
   and adds, result acc + macc. Every path (scalar, AVX2, AVX-512) computes exactly that, so a row's result never
   depends on the pass it is in, the path its row count takes, or the threads. Built by the package at first use with the system C compiler for this CPU (-march=native), without
   -ffast-math and with -ffp-contract=off. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__linux__)
#define TILES 1 /* groups of 16 rows take AMX int8 tiles (tiles_block) */
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define WIDE 1 /* super-blocks of 4 or 8 sub-blocks run 64 bytes of nibbles at a time (wide_rows) */
#endif

#define QK 32
#define OT 16 /* weight rows a thread takes past every group of rows before the next ones */
#define PF 2048 /* bytes of a weight row prefetched ahead: one row's stream alone does not keep DRAM busy */

/* Where sub-block j of a super-block sits in a quantized activation row: in the wide layout every 4 sub-blocks
   are stored 0, 2, 1, 3, the order in which 64 bytes of nibbles hold their low and high halves. */
static inline int slot(int j, int ns) {
#ifdef WIDE
    if (ns % 4 == 0) return (j & ~3) | ((j & 1) << 1) | ((j >> 1) & 1);
#endif
    (void)ns;
    return j;
}

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

static inline int64_t sb_bytes(int ns) { return 4 + 18 * (int64_t)ns; }

/* Row r of x (rows, k) fp32 -> its int8 values in qa (rows, k), its super-blocks' scales in dx (k / SB, rp: row r
   of super-block s at s * rp + r) and its sub-blocks' sums in bs (rows, k / 32). */
static void q8_row(const float *x, int64_t r, int64_t k, int ns, int8_t *qa, float *dx, int64_t rp, int16_t *bs) {
    const int64_t sb = (int64_t)QK * ns, nsb = k / sb;
    for (int64_t s = 0; s < nsb; s++) {
        const float *v = x + r * k + s * sb;
        float amax = 0.f;
        for (int64_t j = 0; j < sb; j++) { float a = fabsf(v[j]); if (a > amax) amax = a; }
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < ns; j++) {
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                int q = (int)nearbyintf(v[j * QK + i] * id);
                qa[r * k + s * sb + slot(j, ns) * QK + i] = (int8_t)q;
                sum += q;
            }
            bs[r * (k / QK) + s * ns + j] = (int16_t)sum;
        }
        dx[s * rp + r] = d;
    }
}

#define RT 4 /* activation rows sharing one unpacked weight super-block */

#ifdef __AVX2__
static inline int32_t hsum128(__m128i v) { /* integer sums: exact in any order */
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1));
    return _mm_cvtsi128_si32(v);
}

/* lane r: the sum of the 4 lanes of m[r] */
static inline __m128i totals4(const __m128i *m) {
    return _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(m[2], m[3]));
}

/* lane r: the sum of the 8 lanes of v[r] (r < 4) */
static inline __m128i totals4x8(const __m256i *v) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
}
#endif
#define WRT 8 /* the same for wide_rows */

#ifdef WIDE
/* lane r (r < 8): the sum of the 16 lanes of v[r] */
static inline __m256i totals8x16(const __m512i *v) {
    __m512i a[4], b[2];
    for (int i = 0; i < 4; i++) /* per 128 bits: rows 2i, 2i + 1, 2i, 2i + 1 */
        a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* per 128 bits: rows 4i .. 4i + 3 */
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
    /* 128-bit parts: rows 0-3 twice, then rows 4-7 twice */
    const __m512i c = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88), _mm512_shuffle_i32x4(b[0], b[1], 0xdd));
    const __m512i d = _mm512_add_epi32(c, _mm512_shuffle_i32x4(c, c, 0xb1));
    return _mm256_set_m128i(_mm512_extracti32x4_epi32(d, 2), _mm512_castsi512_si128(d));
}
#endif

#if defined(__AVX2__) || defined(WIDE)
/* A super-block's header: the row's stream prefetched PF bytes ahead, its fp16 scale and minimum scale (d, dm),
   its sub-scales (sc); returns its nibbles. */
static inline __attribute__((always_inline)) const uint8_t *sb_head(const uint8_t *blk, int ns, float *d, float *dm,
                                                                    const uint8_t **sc) {
    _mm_prefetch((const char *)(blk + PF), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + PF + 64), _MM_HINT_T0);
    _mm_prefetch((const char *)(blk + PF + 128), _MM_HINT_T0);
    uint16_t hd, hm;
    memcpy(&hd, blk, 2);
    memcpy(&hm, blk + 2, 2);
    *d = h2f(hd);
    *dm = h2f(hm);
    *sc = blk + 4;
    return blk + 4 + 2 * ns;
}
#endif

#ifdef __AVX2__
/* Rows r0 .. r0 + R - 1 against one weight row; R is a constant once inlined, so the accumulators live in
   registers. */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *wr, int ns, int64_t nsb, int64_t k,
                                                           const int8_t *qa, const float *dx, int64_t rp,
                                                           const int16_t *bs, const int R, float *res, int64_t stride) {
    const int64_t sb = (int64_t)QK * ns, nbs = k / QK, sbb = sb_bytes(ns);
    float acc1 = 0.f, macc1 = 0.f;
    __m128 acc = _mm_setzero_ps(), macc = _mm_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f);
    /* the sub-minimums beyond NS (bytes of the nibbles that follow) are masked off */
    const __m128i keep = _mm_cmpgt_epi16(_mm_set1_epi16((short)ns), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = wr + s * sbb;
        float d, dm;
        const uint8_t *sc, *qs = sb_head(blk, ns, &d, &dm, &sc);
        __m256i isum[RT];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        if (ns == 1) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
            const __m128i lo4 = _mm256_castsi256_si128(low);
            const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), lo4), _mm_and_si128(raw, lo4));
            const __m256i s0 = _mm256_set1_epi16(sc[0]);
            for (int r = 0; r < R; r++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(qa + r * k + s * sb));
                isum[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), s0);
            }
        } else {
            for (int p = 0; p < ns / 2; p++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
                const __m256i w0 = _mm256_and_si256(raw, low), w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                const __m256i s0 = _mm256_set1_epi16(sc[2 * p]), s1 = _mm256_set1_epi16(sc[2 * p + 1]);
                for (int r = 0; r < R; r++) {
                    const int8_t *a = qa + r * k + s * sb + 64 * p;
                    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_loadu_si256((const __m256i *)a)), s0);
                    const __m256i p1 = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(w1, _mm256_loadu_si256((const __m256i *)(a + 32))), s1);
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(p0, p1));
                }
            }
        }
        int64_t mn8;
        memcpy(&mn8, blk + 4 + ns, 8);
        const __m128i mn = _mm_and_si128(_mm_cvtepi8_epi16(_mm_cvtsi64_si128(mn8)), keep);
        if (R == 1) {
            const float xd = dx[s * rp];
            const __m128i b = _mm_loadu_si128((const __m128i *)(bs + s * ns));
            acc1 += d * xd * (float)hsum128(_mm_add_epi32(_mm256_castsi256_si128(isum[0]),
                                                          _mm256_extracti128_si256(isum[0], 1)));
            macc1 += dm * xd * (float)hsum128(_mm_madd_epi16(mn, b));
        } else { /* the rows' integers, then the float step for all of them at once (lane r: row r) */
            __m128i m[RT];
            for (int r = 0; r < RT; r++) {
                if (r >= R) { isum[r] = _mm256_setzero_si256(); m[r] = _mm_setzero_si128(); continue; }
                m[r] = _mm_madd_epi16(mn, _mm_loadu_si128((const __m128i *)(bs + r * nbs + s * ns)));
            }
            const __m128 xd = _mm_loadu_ps(dx + s * rp);
            acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(d), xd), _mm_cvtepi32_ps(totals4x8(isum))));
            macc = _mm_add_ps(macc, _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(dm), xd), _mm_cvtepi32_ps(totals4(m))));
        }
    }
    if (R == 1) { res[0] = acc1 + macc1; return; }
    float out[4];
    _mm_storeu_ps(out, _mm_add_ps(acc, macc));
    for (int r = 0; r < R; r++) res[r * stride] = out[r];
}
#endif

#ifdef WIDE
/* dot_rows for super-blocks of 4 or 8 sub-blocks with AVX-512: 64 bytes of nibbles are the low and high halves of
   4 sub-blocks; u8 x s8 pairs summed to int16 (maddubs), then times the sub-scale and summed into int32 lanes
   (dpwssd). The activations are in the wide layout (slot). */
static inline __attribute__((always_inline)) void wide_rows(const uint8_t *wr, int ns, int64_t nsb, int64_t k,
                                                            const int8_t *qa, const float *dx, int64_t rp,
                                                            const int16_t *bs, const int16_t *bw, const int R,
                                                            float *res, int64_t stride) {
    const int64_t sb = (int64_t)QK * ns, nbs = k / QK, sbb = sb_bytes(ns);
    float acc1 = 0.f, macc1 = 0.f;
    __m256 acc = _mm256_setzero_ps(), macc = _mm256_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m128i keep = _mm_cmpgt_epi16(_mm_set1_epi16((short)ns), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
    /* int16 lanes 0-15 take sub-scale 4g + h, lanes 16-31 sub-scale 4g + h + 2 (h: 0 low, 1 high) */
    const __m512i pick_lo = _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002LL, 0x0002000200020002LL,
                                              0x0002000200020002LL, 0x0002000200020002LL);
    const __m512i one16 = _mm512_set1_epi16(1), four16 = _mm512_set1_epi16(4);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = wr + s * sbb;
        float d, dm;
        const uint8_t *sc, *qs = sb_head(blk, ns, &d, &dm, &sc);
        int64_t sc8;
        memcpy(&sc8, sc, 8); /* ns = 4: the other 4 bytes are minimums, never picked */
        const __m512i scw = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc8)));
        __m512i isum[WRT];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        __m512i pick = pick_lo;
        for (int g = 0; g < ns / 4; g++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * g));
            const __m512i w0 = _mm512_and_si512(raw, low), w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            const __m512i s0 = _mm512_permutexvar_epi16(pick, scw);
            const __m512i s1 = _mm512_permutexvar_epi16(_mm512_add_epi16(pick, one16), scw);
            pick = _mm512_add_epi16(pick, four16);
            for (int r = 0; r < R; r++) {
                const int8_t *a = qa + r * k + s * sb + 128 * g;
                const __m512i p0 = _mm512_maddubs_epi16(w0, _mm512_loadu_si512((const void *)a));
                const __m512i p1 = _mm512_maddubs_epi16(w1, _mm512_loadu_si512((const void *)(a + 64)));
                isum[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum[r], p0, s0), p1, s1);
            }
        }
        int64_t mn8;
        memcpy(&mn8, blk + 4 + ns, 8);
        const __m128i mn = _mm_and_si128(_mm_cvtepi8_epi16(_mm_cvtsi64_si128(mn8)), keep);
        if (R == 1) {
            const float xd = dx[s * rp];
            const __m128i b = _mm_loadu_si128((const __m128i *)(bs + s * ns));
            acc1 += d * xd * (float)_mm512_reduce_add_epi32(isum[0]);
            macc1 += dm * xd * (float)hsum128(_mm_madd_epi16(mn, b));
        } else if (R == WRT && bw) { /* 8 rows: their integers by a transposing sum, their imin from the
                                       sub-block sums in pairs (bw: row r's sums 2p, 2p + 1 at pair p, r * 2) */
            const __m256i it = totals8x16(isum);
            int32_t mp[4];
            _mm_storeu_si128((__m128i *)mp, mn);
            __m256i mt = _mm256_setzero_si256();
            for (int p = 0; p < ns / 2; p++)
                mt = _mm256_dpwssd_epi32(mt, _mm256_loadu_si256((const __m256i *)(bw + (s * (ns / 2) + p) * 16)),
                                         _mm256_set1_epi32(mp[p]));
            const __m256 xd = _mm256_loadu_ps(dx + s * rp);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), xd), _mm256_cvtepi32_ps(it)));
            macc = _mm256_add_ps(macc, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(dm), xd), _mm256_cvtepi32_ps(mt)));
        } else { /* the rows' integers, then the float step for all of them at once (lane r: row r) */
            __m256i y[WRT];
            __m128i m[WRT];
            for (int r = 0; r < WRT; r++) {
                if (r >= R) { y[r] = _mm256_setzero_si256(); m[r] = _mm_setzero_si128(); continue; }
                y[r] = _mm256_add_epi32(_mm512_castsi512_si256(isum[r]), _mm512_extracti64x4_epi64(isum[r], 1));
                m[r] = _mm_madd_epi16(mn, _mm_loadu_si128((const __m128i *)(bs + r * nbs + s * ns)));
            }
            const __m256i it = _mm256_set_m128i(totals4x8(y + 4), totals4x8(y));
            const __m256i mt = _mm256_set_m128i(totals4(m + 4), totals4(m));
            const __m256 xd = _mm256_loadu_ps(dx + s * rp);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), xd), _mm256_cvtepi32_ps(it)));
            macc = _mm256_add_ps(macc, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(dm), xd), _mm256_cvtepi32_ps(mt)));
        }
    }
    if (R == 1) { res[0] = acc1 + macc1; return; }
    float out[WRT];
    _mm256_storeu_ps(out, _mm256_add_ps(acc, macc));
    for (int r = 0; r < R; r++) res[r * stride] = out[r];
}
#endif

#ifdef TILES
#define TILE_ROWS 16 /* passes of at least this many rows run on the tiles */

/* The kernel lets this process use the tile registers (Linux asks for it once); 0 when it refuses. */
static int tiles_allowed(void) {
    static int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles 0, 1: C (16 weight rows x 16 activation rows, int32) for the high and the low half of the sub-scales;
   2, 3: A (16 weight rows x 64 u8 values: the nibbles times those halves); 4: B (the 16 activation rows' 64 s8
   values in groups of 4: 16 x 64 bytes) */
static void tiles_configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

/* Outputs o0 .. o0 + 15 for every row, from the same integers as wide_rows / dot_rows. A sub-scale sc = 16 sh + sl
   with sh, sl < 16, so a nibble times either half fits a byte: ah = q sh and al = q sl are u8 tiles, and over a
   super-block isum = 16 (ah . a) + (al . a) exactly, two tile products per 64 values whatever the sub-blocks.
   imin (sub-minimums x activation sums) and the float step follow with 16 rows in the lanes.
   ab: 2 x 16 x k bytes of scratch; bt: the rows' values as B tiles (row block, 64 values); bp: the sub-block sums
   in pairs (row block, super-block, pair, 16 rows x 2). */
static void tiles_block(const uint8_t *w, int64_t o0, int64_t n, int64_t k, int ns, int64_t rows, const int8_t *bt,
                        const int16_t *bp, const float *dx, int64_t rp, uint8_t *ab, float *out) {
    const int64_t nsb = k / ((int64_t)QK * ns), sbb = sb_bytes(ns), Q = k / 64, np = (ns + 1) / 2, qs_ = ns / 2;
    uint8_t *ah = ab, *al = ab + 16 * k; /* quarter t of both: 16 rows x 64 bytes at t * 1024 */
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    const __m256i iota = _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float *dw = (float *)(ab + 32 * k), *dmw = dw + nsb * 16; /* per super-block and weight row: d, dmin */
    int32_t *mnw = (int32_t *)(dmw + nsb * 16);                /* and its sub-minimums in pairs (int16 x 2) */
    for (int m = 0; m < 16; m++) {
        const uint8_t *wr = w + (o0 + m) * nsb * sbb;
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *sc = wr + s * sbb + 4, *qs = sc + 2 * ns;
            uint16_t hd, hm;
            memcpy(&hd, wr + s * sbb, 2);
            memcpy(&hm, wr + s * sbb + 2, 2);
            dw[s * 16 + m] = h2f(hd);
            dmw[s * 16 + m] = h2f(hm);
            const int8_t *mn = (const int8_t *)(sc + ns);
            for (int p = 0; p < np; p++) {
                const uint32_t lo = (uint16_t)(int16_t)mn[2 * p];
                const uint32_t hi = 2 * p + 1 < ns ? (uint16_t)(int16_t)mn[2 * p + 1] : 0u;
                mnw[(s * np + p) * 16 + m] = (int32_t)(lo | hi << 16);
            }
            for (int p = 0; p < qs_; p++) { /* sub-blocks 2p, 2p + 1: the low and high nibbles of 32 bytes */
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
                const __m256i q0 = _mm256_and_si256(raw, lo4), q1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
                const int64_t t = s * qs_ + p;
                for (int half = 0; half < 2; half++) {
                    const int s0 = half ? sc[2 * p] & 15 : sc[2 * p] >> 4;
                    const int s1 = half ? sc[2 * p + 1] & 15 : sc[2 * p + 1] >> 4;
                    /* q times the half through a 16-entry table (q < 16) in each 128-bit lane */
                    const __m256i t0 = _mm256_packus_epi16(_mm256_mullo_epi16(iota, _mm256_set1_epi16((short)s0)),
                                                           _mm256_setzero_si256());
                    const __m256i t1 = _mm256_packus_epi16(_mm256_mullo_epi16(iota, _mm256_set1_epi16((short)s1)),
                                                           _mm256_setzero_si256());
                    /* packus leaves entries 0-7 in lane 0 and 8-15 in lane 1: gather all 16 into both lanes */
                    const __m256i tab0 = _mm256_permute4x64_epi64(t0, 0x88), tab1 = _mm256_permute4x64_epi64(t1, 0x88);
                    uint8_t *dst = (half ? al : ah) + t * 1024 + m * 64;
                    _mm256_storeu_si256((__m256i *)dst, _mm256_shuffle_epi8(tab0, q0));
                    _mm256_storeu_si256((__m256i *)(dst + 32), _mm256_shuffle_epi8(tab1, q1));
                }
            }
        }
    }
    int32_t ch[16 * 16], cl[16 * 16];
    for (int64_t rb = 0; rb * 16 < rows; rb++) {
        __m512 acc[16], macc[16];
        for (int m = 0; m < 16; m++) acc[m] = macc[m] = _mm512_setzero_ps();
        for (int64_t s = 0; s < nsb; s++) {
            _tile_zero(0);
            _tile_zero(1);
            for (int p = 0; p < qs_; p++) {
                const int64_t t = s * qs_ + p;
                _tile_loadd(4, bt + (rb * Q + t) * 1024, 64);
                _tile_loadd(2, ah + t * 1024, 64);
                _tile_dpbusd(0, 2, 4);
                _tile_loadd(3, al + t * 1024, 64);
                _tile_dpbusd(1, 3, 4);
            }
            _tile_stored(0, ch, 64);
            _tile_stored(1, cl, 64);
            const __m512 xd = _mm512_loadu_ps(dx + s * rp + rb * 16);
            __m512i sums[4]; /* the rows' sub-block sums, pair by pair (ns <= 8) */
            for (int p = 0; p < np; p++) sums[p] = _mm512_loadu_si512(bp + ((rb * nsb + s) * np + p) * 32);
            for (int m = 0; m < 16; m++) {
                const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(ch + 16 * m), 4),
                                                      _mm512_loadu_si512(cl + 16 * m));
                __m512i imin = _mm512_setzero_si512();
                for (int p = 0; p < np; p++)
                    imin = _mm512_dpwssd_epi32(imin, sums[p], _mm512_set1_epi32(mnw[(s * np + p) * 16 + m]));
                acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(dw[s * 16 + m]), xd),
                                                             _mm512_cvtepi32_ps(isum)));
                macc[m] = _mm512_add_ps(macc[m], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(dmw[s * 16 + m]), xd),
                                                               _mm512_cvtepi32_ps(imin)));
            }
        }
        for (int m = 0; m < 16; m++) {
            float res[16];
            _mm512_storeu_ps(res, _mm512_add_ps(acc[m], macc[m]));
            for (int64_t r = 0; r < 16 && rb * 16 + r < rows; r++) out[(rb * 16 + r) * n + o0 + m] = res[r];
        }
    }
}
#endif

/* out (rows, n) = x (rows, k) fp32 times dequant(w) (n, k) transposed: x's rows quantized (q8_row), then every
   output element one thread's fixed sequence of operations, whatever rows, n or the thread count. One parallel
   region for both (a one-token step runs some hundred of these: each fork and join costs). Returns 0, or -1 when
   the scratch memory cannot be had. ldo: out's row stride (a part of a fused weight writes its columns). */
int q4_matmul_ld(const uint8_t *w, int64_t n, int64_t k, int ns, const float *x, int64_t rows, float *out,
                 int64_t ldo) {
    const int64_t sb = (int64_t)QK * ns, nsb = k / sb, nbs = k / QK, sbb = sb_bytes(ns);
    int8_t *qa = (int8_t *)malloc((size_t)(rows * k));
    const int64_t rp = (rows + 7) / 8 * 8 + 8; /* dx's rows: whole vectors of 8 from any row group */
    float *dx = (float *)calloc((size_t)(rp * nsb), sizeof(float));
    int16_t *bs = (int16_t *)calloc((size_t)(rows * nbs + 8), sizeof(int16_t)); /* read 8 sums at a time */
    if (!qa || !dx || !bs) { free(qa); free(dx); free(bs); return -1; }
    int16_t *bw = NULL; /* wide_rows' sub-block sums for whole groups of 8 rows: per group, super-block, pair */
#ifdef WIDE
    if (rows >= WRT && ns % 4 == 0) {
        bw = (int16_t *)malloc((size_t)(rows / WRT * nsb * (ns / 2) * 16) * sizeof(int16_t));
        if (!bw) { free(qa); free(dx); free(bs); return -1; }
    }
#endif
    int64_t tiled = 0; /* outputs [0, tiled) run on the tiles, in blocks of 16 */
#ifdef TILES
    const int64_t nrb = (rows + 15) / 16, G = k / QK, np = (ns + 1) / 2;
    int8_t *bt = NULL;
    int16_t *bp = NULL;
    if (rows >= TILE_ROWS && n >= 16 && ns % 2 == 0 && tiles_allowed()) {
        bt = (int8_t *)calloc((size_t)(nrb * G * 512), 1);
        bp = (int16_t *)calloc((size_t)(nrb * nsb * np * 32), sizeof(int16_t));
        if (bt && bp) tiled = n / 16 * 16;
    }
#endif
    int failed = 0;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) q8_row(x, r, k, ns, qa, dx, rp, bs);
        if (bw) {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < rows / WRT * WRT; r++)
                for (int64_t s = 0; s < nsb; s++)
                    for (int64_t j = 0; j < ns; j++)
                        bw[((r / WRT * nsb + s) * (ns / 2) + j / 2) * 16 + r % WRT * 2 + j % 2] = bs[r * nbs + s * ns + j];
        }
#ifdef TILES
        if (tiled) {
            /* B tiles: for each 16 rows and 64 values (2 sub-blocks, in order), the values in groups of 4 (byte kk
               of group kq of row r at kq * 64 + r * 4 + kk); the sub-block sums in pairs (row r's sums 2p and
               2p + 1 at r * 2) */
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                const int64_t rb = r / 16, rr = r % 16;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t s = g / ns, j = g % ns;
                    const int8_t *src = qa + r * k + s * ns * QK + slot((int)j, ns) * QK;
                    int8_t *dst = bt + (rb * (k / 64) + g / 2) * 1024 + (g % 2) * 8 * 64 + rr * 4;
                    for (int kq = 0; kq < 8; kq++) memcpy(dst + kq * 64, src + kq * 4, 4);
                }
                for (int64_t s = 0; s < nsb; s++)
                    for (int64_t j = 0; j < ns; j++)
                        bp[((rb * nsb + s) * np + j / 2) * 32 + rr * 2 + j % 2] = bs[r * nbs + s * ns + j];
            }
            uint8_t *ab = (uint8_t *)malloc((size_t)(36 * k)); /* tiles_block's scratch */
            if (!ab) {
                #pragma omp atomic write
                failed = 1;
            }
            tiles_configure();
            #pragma omp for schedule(static)
            for (int64_t ob = 0; ob < tiled / 16; ob++)
                if (ab) tiles_block(w, ob * 16, ldo, k, ns, rows, bt, bp, dx, rp, ab, out);
            _tile_release();
            free(ab);
        }
#endif
        int64_t step = RT; /* rows a weight row's pass takes at once */
#ifdef WIDE
        if (ns % 4 == 0) step = WRT;
#endif
        /* OT weight rows at a time against every group of rows: the tile stays in cache while the groups pass, and
           each group's activations while the tile's rows pass (one weight row against all rows in turn streams all
           activations once per weight row) */
        #pragma omp for schedule(static)
        for (int64_t ot = tiled; ot < n; ot += OT)
        for (int64_t r0 = 0; r0 < rows; r0 += step) {
            const int rt = rows - r0 < step ? (int)(rows - r0) : (int)step;
            for (int64_t o = ot; o < n && o < ot + OT; o++) {
                const uint8_t *wr = w + o * nsb * sbb;
#ifdef __AVX2__
                const int8_t *q = qa + r0 * k;
                const float *d = dx + r0;
                const int16_t *b = bs + r0 * nbs;
                const int16_t *bwr = bw && r0 + WRT <= rows ? bw + r0 / WRT * nsb * (ns / 2) * 16 : NULL;
                float *res = out + r0 * ldo + o;
#ifdef WIDE
                if (ns % 4 == 0) {
                    switch (rt) {
                        case 1: wide_rows(wr, ns, nsb, k, q, d, rp, b, NULL, 1, res, ldo); break;
                        case 2: wide_rows(wr, ns, nsb, k, q, d, rp, b, NULL, 2, res, ldo); break;
                        case 3: wide_rows(wr, ns, nsb, k, q, d, rp, b, NULL, 3, res, ldo); break;
                        case 4: wide_rows(wr, ns, nsb, k, q, d, rp, b, NULL, 4, res, ldo); break;
                        case 5: wide_rows(wr, ns, nsb, k, q, d, rp, b, NULL, 5, res, ldo); break;
                        case 6: wide_rows(wr, ns, nsb, k, q, d, rp, b, NULL, 6, res, ldo); break;
                        case 7: wide_rows(wr, ns, nsb, k, q, d, rp, b, NULL, 7, res, ldo); break;
                        default: wide_rows(wr, ns, nsb, k, q, d, rp, b, bwr, 8, res, ldo); break;
                    }
                    continue;
                }
#endif
                switch (rt) {
                    case 1: dot_rows(wr, ns, nsb, k, q, d, rp, b, 1, res, ldo); break;
                    case 2: dot_rows(wr, ns, nsb, k, q, d, rp, b, 2, res, ldo); break;
                    case 3: dot_rows(wr, ns, nsb, k, q, d, rp, b, 3, res, ldo); break;
                    default: dot_rows(wr, ns, nsb, k, q, d, rp, b, 4, res, ldo); break;
                }
#else
                for (int r = 0; r < rt; r++) {
                    int64_t row = r0 + r;
                    float acc = 0.f, macc = 0.f;
                    for (int64_t s = 0; s < nsb; s++) {
                        const uint8_t *blk = wr + s * sbb, *sc = blk + 4, *qs = blk + 4 + 2 * ns;
                        const int8_t *mn = (const int8_t *)(blk + 4 + ns);
                        uint16_t hd, hm;
                        memcpy(&hd, blk, 2); memcpy(&hm, blk + 2, 2);
                        const int8_t *a = qa + row * k + s * sb;
                        int isum = 0, imin = 0;
                        for (int j = 0; j < ns; j++) {
                            int dot = 0;
                            for (int i = 0; i < QK; i++) {
                                int q;
                                if (ns == 1) q = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
                                else q = j & 1 ? qs[32 * (j / 2) + i] >> 4 : qs[32 * (j / 2) + i] & 15;
                                dot += q * a[j * QK + i];
                            }
                            isum += sc[j] * dot;
                            imin += mn[j] * bs[row * nbs + s * ns + j];
                        }
                        const float xd = dx[s * rp + row];
                        acc += h2f(hd) * xd * (float)isum;
                        macc += h2f(hm) * xd * (float)imin;
                    }
                    out[row * ldo + o] = acc + macc;
                }
#endif
            }
        }
    }
#ifdef TILES
    free(bt);
    free(bp);
#endif
    free(qa);
    free(dx);
    free(bs);
    free(bw);
    return failed ? -1 : 0;
}

int q4_matmul(const uint8_t *w, int64_t n, int64_t k, int ns, const float *x, int64_t rows, float *out) {
    return q4_matmul_ld(w, n, k, ns, x, rows, out, n);
}

float q4_h2f(uint16_t h) { return h2f(h); }
