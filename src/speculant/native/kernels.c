/*
 * Speculant's native CPU kernels: matrix products over GGUF-quantized weights, executed
 * in their stored formats (no dequantized copy), for 1..many activation rows.
 *
 *   y[r, n] = sum_k x[r, k] * W[n, k]      x float32 [m, K], W one or more GGUF parts
 *
 * Numerics are fixed by construction, so that a row's result never depends on the
 * other rows in the call, on the thread count, or on the instruction set:
 *   - activations are quantized per row by one scalar routine (int8 codes per block of
 *     32 for the legacy formats, per 256 with int16 sums per 16 for the K-quants);
 *   - integer block dot products are exact, so their grouping does not matter;
 *   - every float operation (the per-block scaling and the accumulation over blocks)
 *     happens in one fixed order per (row, column), the same in the portable C path, the
 *     AVX2 path and the AVX-512 paths (no fused multiply-add, -ffp-contract=off);
 *   - threads split the output columns only; rows are tiled for weight reuse, but each
 *     row keeps its own accumulators.
 * Tests check all three with torch.equal.
 *
 * The library is loaded with ctypes; the module init below only exists so that the
 * build system can build it as an ordinary extension module.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(_M_X64)
#define SPEC_X86 1
#include <immintrin.h>
#endif

/* GGML type ids (the values stored in GGUF files). */
enum {
    T_F32 = 0,
    T_F16 = 1,
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q5_0 = 6,
    T_Q8_0 = 8,
    T_Q4_K = 12,
    T_Q6_K = 14,
};

/* Code paths, slowest first. Every path computes bitwise the same results. */
enum { PATH_AUTO = 0, PATH_PORTABLE = 1, PATH_AVX2 = 2, PATH_AVX512 = 3, PATH_AVX512VNNI = 4 };
enum { FEAT_AVX2 = 1, FEAT_AVX512 = 2, FEAT_AVX512VNNI = 4 };
#define PATH_LAST PATH_AVX512VNNI

#define MAX_ROWS_TILE 4
#define MAX_PARTS 8

/* ------------------------------------------------------------------ scalar helpers */
static inline float h2f(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v;
    uint32_t s = (uint32_t)(h >> 15) << 31;
    uint32_t e = (h >> 10) & 31u, m = h & 1023u;
    if (e == 0) {
        v.f = (float)m * 0x1p-24f; /* exact: m < 2^10 */
        v.u |= s;
        return v.f;
    }
    if (e == 31) {
        v.u = s | 0x7F800000u | (m << 13);
        return v.f;
    }
    v.u = s | ((e + 112u) << 23) | (m << 13);
    return v.f;
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Bytes per block and values per block of each supported type. */
static int type_block(int type, int *values) {
    switch (type) {
    case T_Q4_0: *values = 32; return 18;
    case T_Q4_1: *values = 32; return 20;
    case T_Q5_0: *values = 32; return 22;
    case T_Q8_0: *values = 32; return 34;
    case T_Q4_K: *values = 256; return 144;
    case T_Q6_K: *values = 256; return 210;
    default: *values = 0; return 0;
    }
}

static inline int is_kquant(int type) { return type == T_Q4_K || type == T_Q6_K; }

/* Q4_K 6-bit scale and min of sub-block j (0..7). */
static inline void q4k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ------------------------------------------------------------ activation quantizing */
/* Legacy-format activations: 32 values per block. */
typedef struct {
    float d;      /* scale */
    float s;      /* d * sum(q), for the Q4_1 min term */
    int8_t q[32];
} xq32;

/* K-quant activations: 256 values per block, sums of each 16. */
typedef struct {
    float d;
    int16_t bsums[16];
    int8_t q[256];
} xq256;

static void quantize_block(const float *x, int n, float *d_out, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.0f;
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < n; i++) {
        float v = nearbyintf(x[i] * id);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[i] = (int8_t)v;
    }
    *d_out = d;
}

static void quantize_row32(const float *x, int64_t K, xq32 *out) {
    for (int64_t b = 0; b < K / 32; b++) {
        quantize_block(x + b * 32, 32, &out[b].d, out[b].q);
        int sum = 0;
        for (int i = 0; i < 32; i++) sum += out[b].q[i];
        out[b].s = out[b].d * (float)sum;
    }
}

static void quantize_row256(const float *x, int64_t K, xq256 *out) {
    for (int64_t b = 0; b < K / 256; b++) {
        quantize_block(x + b * 256, 256, &out[b].d, out[b].q);
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += out[b].q[j * 16 + i];
            out[b].bsums[j] = (int16_t)sum;
        }
    }
}

/* The fixed order in which the 8 lane accumulators of the legacy formats are added. */
static inline float hsum8(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* ------------------------------------------------------------- weight block decoding */
/* Signed codes of one legacy block (Q4_0, Q5_0, Q8_0) or unsigned codes (Q4_1), in value
 * order, and the block's scale (and min for Q4_1). */
static inline void decode_legacy(int type, const uint8_t *blk, int8_t q[32], float *d, float *m) {
    *m = 0.0f;
    *d = 0.0f;
    switch (type) {
    case T_Q4_0:
        *d = h2f(rd16(blk));
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)((blk[2 + j] & 0xF) - 8);
            q[j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
        }
        break;
    case T_Q4_1:
        *d = h2f(rd16(blk));
        *m = h2f(rd16(blk + 2));
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(blk[4 + j] & 0xF);
            q[j + 16] = (int8_t)(blk[4 + j] >> 4);
        }
        break;
    case T_Q5_0: {
        *d = h2f(rd16(blk));
        uint32_t qh = rd32(blk + 2);
        for (int j = 0; j < 16; j++) {
            int lo = (blk[6 + j] & 0xF) | (int)(((qh >> j) & 1u) << 4);
            int hi = (blk[6 + j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
            q[j] = (int8_t)(lo - 16);
            q[j + 16] = (int8_t)(hi - 16);
        }
        break;
    }
    case T_Q8_0:
        *d = h2f(rd16(blk));
        memcpy(q, blk + 2, 32);
        break;
    }
}

/* Q6_K: codes 0..63 (value order) and int8 scales per 16. */
static inline void decode_q6k(const uint8_t *blk, uint8_t q[256], int8_t sc[16], float *d) {
    const uint8_t *ql = blk, *qh = blk + 128;
    memcpy(sc, blk + 192, 16);
    *d = h2f(rd16(blk + 208));
    for (int h = 0; h < 2; h++) {
        const uint8_t *l8 = ql + 64 * h, *h8 = qh + 32 * h;
        uint8_t *o = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (uint8_t)((l8[l] & 0xF) | (((h8[l] >> 0) & 3) << 4));
            o[l + 32] = (uint8_t)((l8[l + 32] & 0xF) | (((h8[l] >> 2) & 3) << 4));
            o[l + 64] = (uint8_t)((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4));
            o[l + 96] = (uint8_t)((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4));
        }
    }
}

/* Q4_K: codes 0..15 (value order), scales and mins per 32. */
static inline void decode_q4k(const uint8_t *blk, uint8_t q[256], int sc[8], int mn[8], float *d,
                              float *dmin) {
    *d = h2f(rd16(blk));
    *dmin = h2f(rd16(blk + 2));
    for (int j = 0; j < 8; j++) q4k_scale_min(blk + 4, j, &sc[j], &mn[j]);
    const uint8_t *qs = blk + 16;
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            q[64 * c + l] = qs[32 * c + l] & 0xF;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    }
}

/* --------------------------------------------------------------- dequantizing rows */
/* out[K] float32: the exact values the stored row stands for. */
static void dequant_row(int type, const uint8_t *row, int64_t K, float *out) {
    int per;
    int bb = type_block(type, &per);
    for (int64_t b = 0; b < K / per; b++) {
        const uint8_t *blk = row + b * bb;
        float *o = out + b * per;
        if (type == T_Q4_K) {
            uint8_t q[256];
            int sc[8], mn[8];
            float d, dmin;
            decode_q4k(blk, q, sc, mn, &d, &dmin);
            for (int j = 0; j < 8; j++) {
                float ds = d * (float)sc[j], dm = dmin * (float)mn[j];
                for (int i = 0; i < 32; i++) o[32 * j + i] = ds * (float)q[32 * j + i] - dm;
            }
        } else if (type == T_Q6_K) {
            uint8_t q[256];
            int8_t sc[16];
            float d;
            decode_q6k(blk, q, sc, &d);
            for (int j = 0; j < 16; j++) {
                float ds = d * (float)sc[j];
                for (int i = 0; i < 16; i++) o[16 * j + i] = ds * (float)((int)q[16 * j + i] - 32);
            }
        } else {
            int8_t q[32];
            float d, m;
            decode_legacy(type, blk, q, &d, &m);
            for (int i = 0; i < 32; i++) o[i] = d * (float)q[i] + m;
        }
    }
}

/* ------------------------------------------------------------------ the job layout */
typedef struct {
    int type;
    const uint8_t *w; /* rows of row_bytes */
    int64_t n;        /* output columns of this part */
    int64_t col0;     /* first output column in y */
    int64_t row_bytes;
} part_t;

typedef struct {
    int nparts;
    part_t parts[MAX_PARTS];
    int64_t K, m, ldy;
    const xq32 *x32;   /* [m][K/32] or NULL */
    const xq256 *x256; /* [m][K/256] or NULL */
    float *y;
    int64_t chunk_cols;
    int64_t nchunks;
    int64_t row_block; /* rows taken together over a chunk's columns (a multiple of 4) */
    int path;
    /* a job other than a matmul (attention): chunk c runs task(ctx, c) */
    void (*task)(const void *ctx, int64_t chunk);
    const void *ctx;
} job_t;

/* ---------------------------------------------------------------- portable kernels */
static void legacy_cols_portable(const job_t *jb, const part_t *p, int64_t c0, int64_t c1) {
    const int64_t nb = jb->K / 32;
    for (int64_t r0 = 0; r0 < jb->m; r0 += MAX_ROWS_TILE) {
        int64_t R = jb->m - r0 < MAX_ROWS_TILE ? jb->m - r0 : MAX_ROWS_TILE;
        for (int64_t c = c0; c < c1; c++) {
            const uint8_t *row = p->w + c * p->row_bytes;
            float acc[MAX_ROWS_TILE][8];
            float accm[MAX_ROWS_TILE];
            memset(acc, 0, sizeof acc);
            memset(accm, 0, sizeof accm);
            for (int64_t b = 0; b < nb; b++) {
                int8_t q[32];
                float d, m;
                int bb, per;
                bb = type_block(p->type, &per);
                decode_legacy(p->type, row + b * bb, q, &d, &m);
                for (int64_t r = 0; r < R; r++) {
                    const xq32 *xb = jb->x32 + (r0 + r) * nb + b;
                    float f = d * xb->d;
                    for (int l = 0; l < 8; l++) {
                        int s = 0;
                        for (int i = 4 * l; i < 4 * l + 4; i++) s += (int)q[i] * (int)xb->q[i];
                        acc[r][l] = acc[r][l] + (float)s * f;
                    }
                    if (p->type == T_Q4_1) accm[r] = accm[r] + m * xb->s;
                }
            }
            for (int64_t r = 0; r < R; r++) {
                float v = hsum8(acc[r]);
                if (p->type == T_Q4_1) v = v + accm[r];
                jb->y[(r0 + r) * jb->ldy + p->col0 + c] = v;
            }
        }
    }
}

static void kquant_cols_portable(const job_t *jb, const part_t *p, int64_t c0, int64_t c1) {
    const int64_t nb = jb->K / 256;
    for (int64_t r0 = 0; r0 < jb->m; r0 += MAX_ROWS_TILE) {
        int64_t R = jb->m - r0 < MAX_ROWS_TILE ? jb->m - r0 : MAX_ROWS_TILE;
        for (int64_t c = c0; c < c1; c++) {
            const uint8_t *row = p->w + c * p->row_bytes;
            float lacc[MAX_ROWS_TILE][8], lmin[MAX_ROWS_TILE][8];
            memset(lacc, 0, sizeof lacc);
            memset(lmin, 0, sizeof lmin);
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * (p->type == T_Q4_K ? 144 : 210);
                uint8_t q[256];
                if (p->type == T_Q4_K) {
                    int sc[8], mn[8];
                    float d, dmin;
                    decode_q4k(blk, q, sc, mn, &d, &dmin);
                    for (int64_t r = 0; r < R; r++) {
                        const xq256 *xb = jb->x256 + (r0 + r) * nb + b;
                        /* lane l: values 4l..4l+3 of each 32-value group, as the
                         * vector path's int32 lanes */
                        float f = d * xb->d, fm = dmin * xb->d;
                        for (int l = 0; l < 8; l++) {
                            int32_t s = 0;
                            for (int j = 0; j < 8; j++) {
                                int32_t dot = 0;
                                for (int i = 32 * j + 4 * l; i < 32 * j + 4 * l + 4; i++)
                                    dot += (int)q[i] * xb->q[i];
                                s += sc[j] * dot;
                            }
                            int32_t mnl = mn[l] * (xb->bsums[2 * l] + xb->bsums[2 * l + 1]);
                            lacc[r][l] = lacc[r][l] + f * (float)s;
                            lmin[r][l] = lmin[r][l] + fm * (float)mnl;
                        }
                    }
                } else {
                    int8_t sc[16];
                    float d;
                    decode_q6k(blk, q, sc, &d);
                    for (int64_t r = 0; r < R; r++) {
                        const xq256 *xb = jb->x256 + (r0 + r) * nb + b;
                        float f = d * xb->d;
                        for (int l = 0; l < 8; l++) {
                            int32_t s = 0;
                            for (int k = 0; k < 8; k++) {
                                int32_t dot = 0;
                                for (int i = 32 * k + 4 * l; i < 32 * k + 4 * l + 4; i++)
                                    dot += (int)q[i] * xb->q[i];
                                s += sc[(32 * k + 4 * l) / 16] * dot;
                            }
                            s -= 32 * (sc[2 * l] * xb->bsums[2 * l] + sc[2 * l + 1] * xb->bsums[2 * l + 1]);
                            lacc[r][l] = lacc[r][l] + f * (float)s;
                        }
                    }
                }
            }
            for (int64_t r = 0; r < R; r++) {
                float v = p->type == T_Q4_K ? hsum8(lacc[r]) - hsum8(lmin[r]) : hsum8(lacc[r]);
                jb->y[(r0 + r) * jb->ldy + p->col0 + c] = v;
            }
        }
    }
}

/* -------------------------------------------------------------------- AVX2 kernels */
#ifdef SPEC_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* Keeps an accumulator in a register where it is: the compiler otherwise reassociates a
 * tile's integer sums into trees of spilled partial sums (integer results are the same
 * either way; only the instruction count differs). */
#define PIN(v) __asm__("" : "+x"(v))

/* The F16C conversion: exact, so bitwise the same as h2f. */
AVX2 static inline float h2f_f16c(uint16_t h) { return _cvtsh_ss(h); }

AVX2 static inline __m256i load_legacy_codes(int type, const uint8_t *blk, float *d, float *m) {
    const __m256i lowmask = _mm256_set1_epi8(0xF);
    __m256i q;
    *m = 0.0f;
    *d = h2f_f16c(rd16(blk));
    switch (type) {
    case T_Q4_0: {
        __m128i b = _mm_loadu_si128((const __m128i *)(blk + 2));
        q = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
        q = _mm256_and_si256(q, lowmask);
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        break;
    }
    case T_Q4_1: {
        *m = h2f_f16c(rd16(blk + 2));
        __m128i b = _mm_loadu_si128((const __m128i *)(blk + 4));
        q = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
        q = _mm256_and_si256(q, lowmask);
        break;
    }
    case T_Q5_0: {
        uint32_t qh = rd32(blk + 2);
        __m128i b = _mm_loadu_si128((const __m128i *)(blk + 6));
        q = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
        q = _mm256_and_si256(q, lowmask);
        /* bit j of qh -> bit 4 of byte j */
        const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                               0x0101010101010101LL, 0x0000000000000000LL);
        __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        hb = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        break;
    }
    default: /* Q8_0 */
        q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        break;
    }
    return q;
}

/* 8 int32 lane sums (lane l: values 4l..4l+3) of signed weight codes times activations. */
AVX2 static inline __m256i dot_signed(__m256i w, __m256i x) {
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

AVX2 static inline __m256i dot_unsigned(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

AVX2 static inline float hsum8_avx(__m256 a) {
    /* ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), as hsum8 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s)); /* (s0+s2, s1+s3) */
    return _mm_cvtss_f32(t) + _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1));
}

AVX2 static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

AVX2 __attribute__((always_inline)) static inline void
legacy_tile_avx2(const job_t *jb, const part_t *p, int64_t r0, int R, int64_t c) {
    const int64_t nb = jb->K / 32;
    int per;
    const int bb = type_block(p->type, &per);
    const uint8_t *row = p->w + c * p->row_bytes;
    const int type = p->type;
    __m256 acc[MAX_ROWS_TILE];
    float accm[MAX_ROWS_TILE];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = 0.0f;
    }
    const xq32 *xbase = jb->x32 + r0 * nb;
    for (int64_t b = 0; b < nb; b++) {
        float d, m;
        __m256i w = load_legacy_codes(type, row + b * bb, &d, &m);
        for (int r = 0; r < R; r++) {
            const xq32 *xb = xbase + r * nb + b;
            __m256i x = _mm256_loadu_si256((const __m256i *)xb->q);
            __m256i s = type == T_Q4_1 ? dot_unsigned(w, x) : dot_signed(w, x);
            __m256 f = _mm256_set1_ps(d * xb->d);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(s), f));
            if (type == T_Q4_1) accm[r] = accm[r] + m * xb->s;
        }
    }
    for (int r = 0; r < R; r++) {
        float v = hsum8_avx(acc[r]);
        if (type == T_Q4_1) v = v + accm[r];
        jb->y[(r0 + r) * jb->ldy + p->col0 + c] = v;
    }
}

AVX2 __attribute__((always_inline)) static inline void
q4k_tile_avx2(const job_t *jb, const part_t *p, int64_t r0, int R, int64_t c) {
    const int64_t nb = jb->K / 256;
    const uint8_t *row = p->w + c * p->row_bytes;
    const __m256i lowmask = _mm256_set1_epi8(0xF);
    __m256 acc[MAX_ROWS_TILE], accm[MAX_ROWS_TILE];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    const xq256 *xbase = jb->x256 + r0 * nb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 144;
        const float d = h2f_f16c(rd16(blk)), dmin = h2f_f16c(rd16(blk + 2));
        /* the 12 scale bytes -> 8 scales and 8 mins (6 bits each), 4 at a time */
        const uint32_t w0 = rd32(blk + 4), w1 = rd32(blk + 8), w2 = rd32(blk + 12);
        const uint32_t sc_lo = w0 & 0x3f3f3f3fu, mn_lo = w1 & 0x3f3f3f3fu;
        const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
        const uint32_t mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
        const __m256i scb = _mm256_set1_epi64x((long long)(((uint64_t)sc_hi << 32) | sc_lo));
        const __m256i mnb = _mm256_set1_epi64x((long long)(((uint64_t)mn_hi << 32) | mn_lo));
        /* int16 lanes: mins each twice (madd with the 16 bsums gives m_j * (bs[2j] +
         * bs[2j+1])), and every scale broadcast */
        const __m256i mins = _mm256_shuffle_epi8(
            mnb, _mm256_setr_epi8(0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3,
                                  -128, 4, -128, 4, -128, 5, -128, 5, -128, 6, -128, 6, -128, 7,
                                  -128, 7, -128));
        /* one 64-value chunk at a time, every row of the tile: few live registers */
        __m256i s[MAX_ROWS_TILE];
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * k));
            const __m256i lo = _mm256_and_si256(q, lowmask);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), lowmask);
            const __m256i slo = _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short)(0x8000 | (2 * k))));
            const __m256i shi =
                _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short)(0x8000 | (2 * k + 1))));
            for (int r = 0; r < R; r++) {
                const xq256 *xb = xbase + r * nb + b;
                __m256i xl = _mm256_loadu_si256((const __m256i *)(xb->q + 64 * k));
                __m256i xh = _mm256_loadu_si256((const __m256i *)(xb->q + 64 * k + 32));
                s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), slo));
                s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), shi));
                PIN(s[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            const xq256 *xb = xbase + r * nb + b;
            __m256i bs = _mm256_loadu_si256((const __m256i *)xb->bsums);
            __m256i mm = _mm256_madd_epi16(bs, mins);
            __m256 f = _mm256_set1_ps(d * xb->d), fm = _mm256_set1_ps(dmin * xb->d);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(f, _mm256_cvtepi32_ps(s[r])));
            accm[r] = _mm256_add_ps(accm[r], _mm256_mul_ps(fm, _mm256_cvtepi32_ps(mm)));
        }
    }
    for (int r = 0; r < R; r++)
        jb->y[(r0 + r) * jb->ldy + p->col0 + c] = hsum8_avx(acc[r]) - hsum8_avx(accm[r]);
}

AVX2 __attribute__((always_inline)) static inline void
q6k_tile_avx2(const job_t *jb, const part_t *p, int64_t r0, int R, int64_t c) {
    const int64_t nb = jb->K / 256;
    const uint8_t *row = p->w + c * p->row_bytes;
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
    __m256 acc[MAX_ROWS_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const xq256 *xbase = jb->x256 + r0 * nb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = h2f_f16c(rd16(blk + 208));
        /* one 32-value chunk at a time, every row of the tile: few live registers */
        __m256i s[MAX_ROWS_TILE];
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hh = _mm256_loadu_si256((const __m256i *)qh);
            /* scales 8h .. 8h+7 as int16 in both lanes; chunk k takes 8h+2k (low lane)
             * and 8h+2k+1 (high lane) */
            const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8 * h)));
            const __m256i both = _mm256_permute2x128_si256(s16, s16, 0x00);
            for (int k = 0; k < 4; k++) {
                const __m256i low = _mm256_and_si256(k & 2 ? _mm256_srli_epi16(k & 1 ? l1 : l0, 4)
                                                           : (k & 1 ? l1 : l0),
                                                     m4);
                const __m256i high =
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2 * k), m2), 4);
                const __m256i q = _mm256_or_si256(low, high);
                const short lo16 = (short)(((4 * k + 1) << 8) | (4 * k));
                const short hi16 = (short)(((4 * k + 3) << 8) | (4 * k + 2));
                const __m256i idx = _mm256_set_m128i(_mm_set1_epi16(hi16), _mm_set1_epi16(lo16));
                const __m256i scv = _mm256_shuffle_epi8(both, idx);
                for (int r = 0; r < R; r++) {
                    const xq256 *xb = xbase + r * nb + b;
                    __m256i x = _mm256_loadu_si256((const __m256i *)(xb->q + 128 * h + 32 * k));
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scv));
                    PIN(s[r]);
                }
            }
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        for (int r = 0; r < R; r++) {
            const xq256 *xb = xbase + r * nb + b;
            __m256i bs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), sc16);
            __m256i st = _mm256_sub_epi32(s[r], _mm256_slli_epi32(bs, 5));
            __m256 f = _mm256_set1_ps(d * xb->d);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(f, _mm256_cvtepi32_ps(st)));
        }
    }
    for (int r = 0; r < R; r++) jb->y[(r0 + r) * jb->ldy + p->col0 + c] = hsum8_avx(acc[r]);
}

/* Constant-R specializations, so the row loops unroll and accumulators stay in registers. */
#define SPEC_TILES(name)                                                                        \
    AVX2 static void name##_r1(const job_t *j, const part_t *p, int64_t r0, int64_t c) {        \
        name##_tile_avx2(j, p, r0, 1, c);                                                       \
    }                                                                                           \
    AVX2 static void name##_r2(const job_t *j, const part_t *p, int64_t r0, int64_t c) {        \
        name##_tile_avx2(j, p, r0, 2, c);                                                       \
    }                                                                                           \
    AVX2 static void name##_r3(const job_t *j, const part_t *p, int64_t r0, int64_t c) {        \
        name##_tile_avx2(j, p, r0, 3, c);                                                       \
    }                                                                                           \
    AVX2 static void name##_r4(const job_t *j, const part_t *p, int64_t r0, int64_t c) {        \
        name##_tile_avx2(j, p, r0, 4, c);                                                       \
    }
SPEC_TILES(legacy)
SPEC_TILES(q4k)
SPEC_TILES(q6k)

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

typedef void (*tile_fn)(const job_t *, const part_t *, int64_t, int64_t);
/* one instruction set's tiles: [legacy, Q4_K, Q6_K][R - 1] */
typedef tile_fn tile_set[3][MAX_ROWS_TILE];

static const tile_set tiles_avx2 = {
    {legacy_r1, legacy_r2, legacy_r3, legacy_r4},
    {q4k_r1, q4k_r2, q4k_r3, q4k_r4},
    {q6k_r1, q6k_r2, q6k_r3, q6k_r4},
};

static void cols_run(const job_t *jb, const part_t *p, int64_t c0, int64_t c1, const tile_set *ts) {
    const tile_fn *fns = (*ts)[p->type == T_Q4_K ? 1 : (p->type == T_Q6_K ? 2 : 0)];
    /* column outer, row tiles inner: a column's blocks stay in L1 across the tiles.
     * Many rows (a prefill) are taken a block of rows at a time, so that the block's
     * quantized activations stay in L2 while the chunk's columns pass over them (all
     * rows at once would stream every activation from L3 again for every column). */
    const int64_t rb = jb->row_block;
    if (jb->m <= MAX_ROWS_TILE) {
        /* One tile: the pass is bound by reading the weights. Ask for the column
         * PREFETCH_BYTES ahead while this one is computed, so that the loads are in
         * flight across the chunk's start and the compute (the hardware prefetcher
         * alone left a 1-row pass at ~15 of the ~25 GB/s two cores can read). */
        const int64_t ahead = (PREFETCH_BYTES + p->row_bytes - 1) / p->row_bytes;
        const tile_fn fn = fns[jb->m - 1];
        for (int64_t c = c0; c < c1; c++) {
            if (c + ahead < p->n) {
                const char *nx = (const char *)p->w + (c + ahead) * p->row_bytes;
                for (int64_t o = 0; o < p->row_bytes; o += 64) _mm_prefetch(nx + o, _MM_HINT_T0);
            }
            fn(jb, p, 0, c);
        }
        return;
    }
    for (int64_t b0 = 0; b0 < jb->m; b0 += rb) {
        const int64_t b1 = b0 + rb < jb->m ? b0 + rb : jb->m;
        for (int64_t c = c0; c < c1; c++) {
            for (int64_t r0 = b0; r0 < b1; r0 += MAX_ROWS_TILE) {
                int64_t R = b1 - r0 < MAX_ROWS_TILE ? b1 - r0 : MAX_ROWS_TILE;
                fns[R - 1](jb, p, r0, c);
            }
        }
    }
}

/* ------------------------------------------------------------------ AVX-512 kernels */
#define T512_VNNI 0
#define T512_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define T512_FN(name) name##_avx512
#include "tiles512.h"
#undef T512_VNNI
#undef T512_ATTR
#undef T512_FN

#define T512_VNNI 1
#define T512_ATTR                                                                               \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define T512_FN(name) name##_vnni
#include "tiles512.h"
#undef T512_VNNI
#undef T512_ATTR
#undef T512_FN
#endif

/* --------------------------------------------------------------------- dispatching */
static int g_features = -1;
static int g_path = PATH_AUTO;

static int features(void) {
    if (g_features < 0) {
        int f = 0;
#ifdef SPEC_X86
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            __builtin_cpu_supports("f16c"))
            f |= FEAT_AVX2;
        if ((f & FEAT_AVX2) && __builtin_cpu_supports("avx512f") &&
            __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("avx512dq"))
            f |= FEAT_AVX512;
        if ((f & FEAT_AVX512) && __builtin_cpu_supports("avx512vnni")) f |= FEAT_AVX512VNNI;
#endif
        g_features = f;
    }
    return g_features;
}

/* whether this CPU runs a path */
static int path_ok(int path) {
    static const int need[PATH_LAST + 1] = {0, 0, FEAT_AVX2, FEAT_AVX512, FEAT_AVX512VNNI};
    return path >= PATH_PORTABLE && path <= PATH_LAST && (features() & need[path]) == need[path];
}

static int resolve_path(void) {
    if (g_path != PATH_AUTO) return path_ok(g_path) ? g_path : -1;
    /* Auto takes AVX2 where it exists: the 512-bit paths are bitwise equal but measured no
     * faster on a Zen 4 EPYC (docs/native.md), so they stay opt-in until one wins. */
    if (path_ok(PATH_AVX2)) return PATH_AVX2;
    return PATH_PORTABLE;
}

static void run_chunk(const job_t *jb, int64_t chunk) {
    if (jb->task) {
        jb->task(jb->ctx, chunk);
        return;
    }
    /* chunk -> (part, column range) */
    int64_t first = chunk * jb->chunk_cols;
    int64_t last = first + jb->chunk_cols;
    for (int i = 0; i < jb->nparts; i++) {
        const part_t *p = &jb->parts[i];
        int64_t a = p->col0, e = p->col0 + p->n;
        int64_t lo = first > a ? first : a, hi = last < e ? last : e;
        if (lo >= hi) continue;
#ifdef SPEC_X86
        if (jb->path >= PATH_AVX2) {
            const tile_set *ts = jb->path == PATH_AVX512VNNI ? &tiles_vnni
                                 : jb->path == PATH_AVX512 ? &tiles_avx512
                                                           : &tiles_avx2;
            cols_run(jb, p, lo - a, hi - a, ts);
            continue;
        }
#endif
        if (is_kquant(p->type))
            kquant_cols_portable(jb, p, lo - a, hi - a);
        else
            legacy_cols_portable(jb, p, lo - a, hi - a);
    }
}

/* ------------------------------------------------------------------- thread pool */
/* Workers spin briefly after each job (the next projection usually follows within
 * microseconds), then sleep on a condition variable. Columns are handed out through an
 * atomic counter; the caller's thread works too. */
#define MAX_THREADS 64

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th[MAX_THREADS];
    int nworkers;
    int sleepers;
    int quit;
    atomic_int gen;
    atomic_llong next;
    atomic_int finished;
    const job_t *job;
    int spin_us;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#ifdef SPEC_X86
    _mm_pause();
#endif
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static void work(const job_t *jb) {
    for (;;) {
        long long c = atomic_fetch_add(&pool.next, 1);
        if (c >= jb->nchunks) break;
        run_chunk(jb, c);
    }
}

static void *worker_main(void *arg) {
    int seen = (int)(intptr_t)arg; /* the generation when the pool was (re)built */
    for (;;) {
        double t0 = now_us();
        int spins = 0;
        while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen) {
            cpu_relax();
            if (++spins % 256 == 0 && now_us() - t0 > pool.spin_us) {
                pthread_mutex_lock(&pool.mu);
                pool.sleepers++;
                while (atomic_load(&pool.gen) == seen && !pool.quit)
                    pthread_cond_wait(&pool.cv, &pool.mu);
                pool.sleepers--;
                pthread_mutex_unlock(&pool.mu);
                break;
            }
        }
        if (pool.quit) return NULL;
        seen = atomic_load(&pool.gen);
        work(pool.job);
        atomic_fetch_add_explicit(&pool.finished, 1, memory_order_release);
    }
}

static void pool_stop(void) {
    if (pool.nworkers == 0) return;
    pthread_mutex_lock(&pool.mu);
    pool.quit = 1;
    atomic_fetch_add(&pool.gen, 1);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    for (int i = 0; i < pool.nworkers; i++) pthread_join(pool.th[i], NULL);
    pool.nworkers = 0;
    pool.quit = 0;
}

static void after_fork_child(void) {
    /* the workers do not exist in a forked child */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.nworkers = 0;
    pool.sleepers = 0;
    pool.quit = 0;
}

static int pool_resize(int n) {
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(NULL, NULL, after_fork_child);
        atfork = 1;
        const char *spin = getenv("SPECULANT_SPIN_US");
        pool.spin_us = spin ? atoi(spin) : 2000;
    }
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n - 1 == pool.nworkers) return 0;
    pool_stop();
    intptr_t gen = atomic_load(&pool.gen);
    for (int i = 0; i < n - 1; i++) {
        if (pthread_create(&pool.th[i], NULL, worker_main, (void *)gen) != 0) break;
        pool.nworkers++;
    }
    return 0;
}

static void pool_run(const job_t *jb, int nthreads) {
    if (nthreads <= 1 || jb->nchunks <= 1) {
        for (int64_t c = 0; c < jb->nchunks; c++) run_chunk(jb, c);
        return;
    }
    pool_resize(nthreads);
    pool.job = jb;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.finished, 0);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.gen, 1, memory_order_release);
    if (pool.sleepers) pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    work(jb);
    while (atomic_load_explicit(&pool.finished, memory_order_acquire) < pool.nworkers) cpu_relax();
}

/* ------------------------------------------------------------------------ the API */
int spec_features(void) { return features(); }

/* 0 auto, 1 portable, 2 avx2, 3 avx512, 4 avx512vnni; -1 for a path this CPU lacks. */
int spec_set_path(int path) {
    if (path != PATH_AUTO && !path_ok(path)) return -1;
    g_path = path;
    return 0;
}

int spec_active_path(void) { return resolve_path(); }

int spec_supported(int type) {
    int per;
    return type_block(type, &per) > 0;
}

/* Bytes of one stored row of K values (0 when the type or K is unsupported). */
int64_t spec_row_bytes(int type, int64_t K) {
    int per;
    int bb = type_block(type, &per);
    if (bb == 0 || K % per) return 0;
    return K / per * bb;
}

/* y[r * ldy + c] for r < m and the parts' columns (concatenated in order).
 * Returns 0, or a negative code: -1 unsupported type, -2 K not a block multiple,
 * -3 too many parts, -4 out of memory. */
int spec_linear(int nparts, const int *types, const void *const *weights, const int64_t *ns,
                int64_t K, const float *x, int64_t m, float *y, int64_t ldy, int nthreads) {
    if (nparts < 1 || nparts > MAX_PARTS) return -3;
    job_t jb;
    memset(&jb, 0, sizeof jb);
    int need32 = 0, need256 = 0;
    int64_t col = 0;
    for (int i = 0; i < nparts; i++) {
        int64_t rb = spec_row_bytes(types[i], K);
        if (!spec_supported(types[i])) return -1;
        if (rb == 0) return -2;
        jb.parts[i] = (part_t){types[i], (const uint8_t *)weights[i], ns[i], col, rb};
        col += ns[i];
        if (is_kquant(types[i]))
            need256 = 1;
        else
            need32 = 1;
    }
    jb.nparts = nparts;
    jb.K = K;
    jb.m = m;
    jb.ldy = ldy;
    jb.y = y;
    jb.path = resolve_path();
    if (jb.path < 0) jb.path = PATH_PORTABLE;
    xq32 *x32 = NULL;
    xq256 *x256 = NULL;
    if (need32) {
        x32 = malloc(sizeof(xq32) * (size_t)(m * (K / 32)));
        if (!x32) return -4;
        for (int64_t r = 0; r < m; r++) quantize_row32(x + r * K, K, x32 + r * (K / 32));
    }
    if (need256) {
        x256 = malloc(sizeof(xq256) * (size_t)(m * (K / 256)));
        if (!x256) {
            free(x32);
            return -4;
        }
        for (int64_t r = 0; r < m; r++) quantize_row256(x + r * K, K, x256 + r * (K / 256));
    }
    jb.x32 = x32;
    jb.x256 = x256;
    /* Columns per chunk: enough work per chunk to amortize the hand-out, enough chunks
     * to balance the threads. Results do not depend on it. */
    int64_t cc = 16;
    if (nthreads > 1) {
        int64_t target = col / ((int64_t)nthreads * 8);
        cc = target < 4 ? 4 : (target > 64 ? 64 : target);
    } else {
        cc = col;
    }
    /* Rows per block: their quantized activations within ~128 KiB (L2 with the chunk's
     * weights), and a chunk's weights within ~64 KiB when the rows are many. */
    int64_t xrow = need256 ? (int64_t)sizeof(xq256) * (K / 256) : 0;
    if (need32 && (int64_t)sizeof(xq32) * (K / 32) > xrow) xrow = (int64_t)sizeof(xq32) * (K / 32);
    int64_t rbk = ((int64_t)128 * 1024 / xrow) / MAX_ROWS_TILE * MAX_ROWS_TILE;
    jb.row_block = rbk < MAX_ROWS_TILE ? MAX_ROWS_TILE : rbk;
    if (m > jb.row_block) {
        int64_t maxrb = 0;
        for (int i = 0; i < nparts; i++)
            if (jb.parts[i].row_bytes > maxrb) maxrb = jb.parts[i].row_bytes;
        int64_t capc = (int64_t)64 * 1024 / maxrb;
        if (capc < 4) capc = 4;
        if (cc > capc) cc = capc;
    }
    jb.chunk_cols = cc;
    jb.nchunks = (col + cc - 1) / cc;
    pool_run(&jb, nthreads);
    free(x32);
    free(x256);
    return 0;
}

/* out[i, :] = dequantized row idx[i] of a [rows, K] stored matrix. */
int spec_dequant_rows(int type, const void *w, int64_t K, const int64_t *idx, int64_t n,
                      float *out) {
    int64_t rb = spec_row_bytes(type, K);
    if (rb == 0) return -1;
    for (int64_t i = 0; i < n; i++)
        dequant_row(type, (const uint8_t *)w + idx[i] * rb, K, out + i * K);
    return 0;
}

/* The activation quantizer, exposed for tests: codes [m, K] and scales. */
int spec_quantize_rows(int kquant, const float *x, int64_t K, int64_t m, int8_t *codes,
                       float *scales) {
    int per = kquant ? 256 : 32;
    if (K % per) return -2;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < K / per; b++)
            quantize_block(x + r * K + b * per, per, &scales[r * (K / per) + b],
                           codes + r * K + b * per);
    return 0;
}


/* ------------------------------------------------- attention and RMS norm (float32) */
/* Both reduce in a fixed order that depends on nothing but the row itself: 8 lanes
 * (lane l takes elements l, l+8, ...), added as hsum8; keys visited in ascending order.
 * A query row's result is therefore the same whatever else shares the pass, however long
 * the key span, and on either path (the AVX2 code does the same float operations, with
 * no fused multiply-add). */
static float dot8_portable(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    for (int64_t i = 0; i < n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] = acc[l] + a[i + l] * b[i + l];
    return hsum8(acc);
}

/* y[i] += p * v[i] */
static void axpy_portable(float *y, float p, const float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = y[i] + p * v[i];
}

#ifdef SPEC_X86
AVX2 static float dot8_avx2(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    return hsum8_avx(acc);
}

AVX2 static void axpy_avx2(float *y, float p, const float *v, int64_t n) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(
            y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_mul_ps(pv, _mm256_loadu_ps(v + i))));
}
#endif

typedef struct {
    const float *q, *k, *v;
    float *out;
    int64_t T, nh, nkv, hd, rows;
    int64_t q_t, q_h, o_t, o_h; /* strides of a query / output row and head */
    const int64_t *lo, *hi;
    float scale;
    int path;
    atomic_int failed; /* a pair's score buffer could not be allocated */
} attn_t;

/* One (query head, query row) pair: chunk = h * T + t. */
static void attend_one(const void *ctx, int64_t chunk) {
    const attn_t *a = ctx;
    const int64_t h = chunk / a->T, t = chunk % a->T;
    const int64_t g = h / (a->nh / a->nkv);
    const float *q = a->q + t * a->q_t + h * a->q_h;
    const float *keys = a->k + g * a->rows * a->hd, *vals = a->v + g * a->rows * a->hd;
    float *o = a->out + t * a->o_t + h * a->o_h;
    const int64_t lo = a->lo[t], hi = a->hi[t], n = hi - lo;
    float (*dot)(const float *, const float *, int64_t) = dot8_portable;
    void (*axpy)(float *, float, const float *, int64_t) = axpy_portable;
#ifdef SPEC_X86
    if (a->path >= PATH_AVX2) { /* the AVX-512 paths take the same 256-bit float code */
        dot = dot8_avx2;
        axpy = axpy_avx2;
    }
#endif
    for (int64_t i = 0; i < a->hd; i++) o[i] = 0.0f;
    if (n <= 0) return;
    float stack[1024];
    float *s = n <= 1024 ? stack : malloc(sizeof(float) * (size_t)n);
    if (!s) {
        atomic_store(&((attn_t *)a)->failed, 1);
        return;
    }
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        s[j] = dot(q, keys + (lo + j) * a->hd, a->hd) * a->scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - mx);
        sum = sum + s[j];
    }
    for (int64_t j = 0; j < n; j++) axpy(o, s[j], vals + (lo + j) * a->hd, a->hd);
    for (int64_t i = 0; i < a->hd; i++) o[i] = o[i] / sum;
    if (s != stack) free(s);
}

/* Attention of T query rows: q [nh][T][hd]; k, v [nkv][rows][hd] (one layer's cache);
 * query row t sees keys [lo[t], hi[t]). out [nh][T][hd]. Returns 0, or -1 for a shape
 * it does not take (hd not a multiple of 8, nh not a multiple of nkv, a range past rows). */
/* Returns 0, or -4 when a score buffer could not be allocated. */
static int run_attention(attn_t *a, int nthreads) {
    if (a->path < 0) a->path = PATH_PORTABLE;
    const int64_t T = a->T, nh = a->nh, hd = a->hd;
    const int64_t *lo = a->lo, *hi = a->hi;
    job_t jb;
    memset(&jb, 0, sizeof jb);
    jb.task = attend_one;
    jb.ctx = a;
    jb.nchunks = nh * T;
    /* split only when there is enough work to pay for waking the workers */
    int64_t work = nh * T * (hi[T - 1] - lo[T - 1]) * hd;
    pool_run(&jb, work >= (1 << 18) ? nthreads : 1);
    return atomic_load(&a->failed) ? -4 : 0;
}

static int ranges_ok(int64_t T, const int64_t *lo, const int64_t *hi, int64_t rows) {
    for (int64_t t = 0; t < T; t++)
        if (lo[t] < 0 || hi[t] > rows) return 0;
    return 1;
}

int spec_attend(const float *q, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const float *k,
                const float *v, int64_t rows, const int64_t *lo, const int64_t *hi, float scale,
                float *out, int nthreads) {
    if (hd <= 0 || hd % 8 || nkv <= 0 || nh % nkv || !ranges_ok(T, lo, hi, rows)) return -1;
    attn_t a = {q, k, v, out, T, nh, nkv, hd, rows, hd, T * hd, hd, T * hd, lo, hi, scale,
                resolve_path(), 0};
    return run_attention(&a, nthreads);
}

/* Rotary embedding (rotate-half layout) of one head: the same float operations as the
 * decoder's torch code (x * cos + rotated * sin, elementwise), so bitwise the same. */
static void rope_head(const float *x, const float *cos, const float *sin, int64_t hd, float *y) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        y[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
        y[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

/* A chain's attention block after the fused q/k/v projection: qkv [T][ld] (q heads, then
 * k heads, then v heads), cos / sin [T][hd] for its positions; writes the roped keys and
 * the values to cache rows start .. start+T-1 of kc / vc [nkv][rows][hd], then attends
 * (query row t sees keys [lo[t], hi[t])) into out [T][nh * hd]. */
int spec_rope_attend(const float *qkv, int64_t T, int64_t ld, int64_t nh, int64_t nkv, int64_t hd,
                     const float *cos, const float *sin, float *kc, float *vc, int64_t rows,
                     int64_t start, const int64_t *lo, const int64_t *hi, float scale,
                     float *out, int nthreads) {
    if (hd <= 0 || hd % 8 || nkv <= 0 || nh % nkv || ld < (nh + 2 * nkv) * hd) return -1;
    if (start < 0 || start + T > rows || !ranges_ok(T, lo, hi, rows)) return -1;
    float *qr = malloc(sizeof(float) * (size_t)(T * nh * hd));
    if (!qr) return -4;
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * ld, *c = cos + t * hd, *s = sin + t * hd;
        for (int64_t h = 0; h < nh; h++) rope_head(row + h * hd, c, s, hd, qr + (t * nh + h) * hd);
        for (int64_t g = 0; g < nkv; g++) {
            float *kd = kc + (g * rows + start + t) * hd, *vd = vc + (g * rows + start + t) * hd;
            rope_head(row + (nh + g) * hd, c, s, hd, kd);
            memcpy(vd, row + (nh + nkv + g) * hd, sizeof(float) * (size_t)hd);
        }
    }
    attn_t a = {qr, kc, vc, out, T, nh, nkv, hd, rows, nh * hd, hd, nh * hd, hd, lo, hi, scale,
                resolve_path(), 0};
    int rc = run_attention(&a, nthreads);
    free(qr);
    return rc;
}

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows of d values (d a multiple of 8). */
int spec_rms_norm(const float *x, const float *w, int64_t m, int64_t d, float eps, float *y) {
    if (d <= 0 || d % 8) return -1;
    int path = resolve_path();
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float ss;
#ifdef SPEC_X86
        if (path >= PATH_AVX2)
            ss = dot8_avx2(xr, xr, d);
        else
#endif
            ss = dot8_portable(xr, xr, d);
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (int64_t i = 0; i < d; i++) yr[i] = (xr[i] * inv) * w[i];
    }
    return 0;
}

/* --------------------------------------------------- a module so setuptools builds it */
#ifdef SPEC_PYTHON_MODULE
#include <Python.h>
static struct PyModuleDef spec_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                         "Speculant's native kernels (loaded with ctypes).", -1,
                                         NULL};
PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&spec_module); }
#endif
