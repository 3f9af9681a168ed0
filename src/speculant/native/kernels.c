/*
 * Speculant's native CPU kernels: matrix products over GGUF-quantized weights, executed
 * in their stored formats (repacked exactly at load: the same codes and scales, permuted
 * so that a vector lane collects one scale group), for 1..many activation rows.
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
 *     AVX2 path and the AVX-512 paths: fused multiply-adds only where written (fmaf /
 *     vfmadd, one rounding either way), none made by the compiler (-ffp-contract=off);
 *   - threads split the output columns only; rows are tiled for weight reuse, but each
 *     row keeps its own accumulators.
 * Tests check every path against the portable one with torch.equal.
 *
 * The library is loaded with ctypes; the module init below only exists so that the
 * build system can build it as an ordinary extension module.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(SPEC_PORTABLE_ONLY)
#define SPEC_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif
/* AMX tiles (prefill's Q4_K matmuls on CPUs that have them): compilers that know the
 * instructions, on Linux, whose kernel hands the tile state out by arch_prctl */
#if defined(SPEC_X86) && defined(__linux__) &&                                             \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define SPEC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
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
enum { FEAT_AVX2 = 1, FEAT_AVX512 = 2, FEAT_AVX512VNNI = 4, FEAT_AMX = 8 };
#define PATH_LAST PATH_AVX512VNNI

#define MAX_ROWS_TILE 8 /* rows of the tallest tile */
#define MANY_ROWS_TILE 4 /* rows of a tile in passes of many rows */
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

/* float -> float16, rounded to nearest (ties to even), as F16C's vcvtps2ph and torch's
 * conversion round: past the largest float16 (65504) to infinity, below 2^-14 to a
 * subnormal (or zero); a NaN stays a (quiet) NaN. */
static inline uint16_t f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)(x >> 16 & 0x8000u);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | (ax >> 13 & 0x3FFu)); /* NaN */
    if (ax >= 0x47800000u) return (uint16_t)(sign | 0x7C00u); /* 2^16 and up (and inf) */
    if (ax < 0x38800000u) { /* below 2^-14: a multiple of 2^-24, rounded as rint rounds */
        float a;
        memcpy(&a, &ax, sizeof a);
        return (uint16_t)(sign | (uint16_t)nearbyintf(a * 0x1p24f)); /* exact product */
    }
    /* rebias the exponent (127 -> 15), then drop 13 mantissa bits, ties to even; a carry
     * into the exponent is right (up to 0x7C00, infinity, from 65520 on) */
    const uint32_t r = ax - 0x38000000u;
    return (uint16_t)(sign | ((r + 0xFFFu + (r >> 13 & 1u)) >> 13));
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

/* Q4_K's 8 scales and 8 mins (6 bits each) from its 12 packed bytes, one per byte of
 * *sc8 / *mn8 (sub-block j in byte j). Sub-blocks 0-3 keep their scale in the low 6 bits
 * of byte j and their min in byte j + 4; sub-blocks 4-7 take the low 4 bits of byte j + 4
 * (scale) or its high 4 bits (min), and the top 2 bits from the spare top bits of bytes
 * j - 4 (scale) and j (min). Worked on three 32-bit words: a = bytes 0-3, b = bytes 4-7,
 * c = bytes 8-11. */
static inline void q4k_scales8(const uint8_t *s, uint64_t *sc8, uint64_t *mn8) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t lo6 = 0x3F3F3F3Fu, lo4 = 0x0F0F0F0Fu, lo2 = 0x03030303u;
    const uint32_t sc_hi = (c & lo4) | (((a >> 6) & lo2) << 4);
    const uint32_t mn_hi = ((c >> 4) & lo4) | (((b >> 6) & lo2) << 4);
    *sc8 = (uint64_t)(a & lo6) | ((uint64_t)sc_hi << 32);
    *mn8 = (uint64_t)(b & lo6) | ((uint64_t)mn_hi << 32);
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

/* Q4_K's 256 codes in value order. */
static inline void q4k_codes(const uint8_t *blk, uint8_t q[256]) {
    const uint8_t *qs = blk + 16;
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            q[64 * c + l] = qs[32 * c + l] & 0xF;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    }
}

/* Q4_K: codes 0..15 (value order), scales and mins per 32. */
static inline void decode_q4k(const uint8_t *blk, uint8_t q[256], int sc[8], int mn[8], float *d,
                              float *dmin) {
    *d = h2f(rd16(blk));
    *dmin = h2f(rd16(blk + 2));
    uint64_t sc8, mn8;
    q4k_scales8(blk + 4, &sc8, &mn8);
    for (int j = 0; j < 8; j++) {
        sc[j] = (int)((sc8 >> (8 * j)) & 0xFF);
        mn[j] = (int)((mn8 >> (8 * j)) & 0xFF);
    }
    q4k_codes(blk, q);
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

/* -------------------------------------------------------------- repacked weights */
/*
 * Every matrix is repacked once at load, exactly: the codes are permuted and the scales
 * kept as stored, nothing is requantized. A 256-value unit (a K-quant block, or a group
 * of 8 legacy blocks of 32) is seen as 8 "registers" of 32 bytes; byte j = 4l + b of
 * register t belongs to 32-bit lane l. The permutation puts one scale group in each lane,
 * so a lane's integer dot product (4 byte products per register, summed over registers)
 * needs its scale once per unit instead of once per register:
 *   Q4_K and legacy groups ("by 32"): register t, lane l, byte b holds value 32l + 4t + b
 *     (lane l: the 32-value sub-block l, or legacy block l);
 *   Q6_K ("by 16"): register t, lane l, byte b holds value 16 (l + 8 (t >> 2)) + 4 (t & 3)
 *     + b: registers 0-3 cover the 16-value groups 0-7 (lane l: group l), registers 4-7
 *     the groups 8-15 (lane l: group 8 + l).
 * The activations are quantized into the same orders (quantize_row_k / quantize_row_g).
 *
 * Packed units (codes unsigned; nibble pairs put register c in the low and c + 4 in the
 * high nibble of byte j of chunk c):
 *   Q4_K 144 B: d, dmin, the 12 bytes of 6-bit scales and mins as the file packs them
 *     (q4k_scales8 unpacks them per block), 4 nibble chunks of 32 B.
 *   Q6_K 210 B: 4 nibble chunks (low 4 bits), 2 chunks of 32 B with the high 2 bits of
 *     registers 4h .. 4h + 3 at bits 0-1, 2-3, 4-5, 6-7 of chunk h, the 16 int8 scales, d.
 *   Q4_0 144 B: 8 fp16 scales, 4 nibble chunks (codes 0..15, value = d (code - 8)).
 *   Q4_1 160 B: 8 fp16 scales, 8 fp16 mins, 4 nibble chunks.
 *   Q5_0 176 B: 8 fp16 scales, 32 B of high bits (bit t of byte j: register t), 4 nibble
 *     chunks (codes 0..31, value = d (code - 16)).
 *   Q8_0 272 B: 8 fp16 scales, 8 registers of codes w + 128 (value = d (code - 128)).
 * A row's last legacy group is padded with zero blocks (zero scales and codes).
 */
static inline int by32(int t, int l, int b) { return 32 * l + 4 * t + b; }
static inline int by16(int t, int l, int b) { return 16 * (l + 8 * (t >> 2)) + 4 * (t & 3) + b; }

/* Bytes of a packed 256-value unit. */
static int unit_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 16 + 128;
    case T_Q4_1: return 32 + 128;
    case T_Q5_0: return 16 + 32 + 128;
    case T_Q8_0: return 16 + 256;
    case T_Q4_K: return 144;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* Units per row of K values: 256-value blocks, or groups of 8 legacy blocks. */
static inline int64_t row_units(int type, int64_t K) {
    return is_kquant(type) ? K / 256 : (K / 32 + 7) / 8;
}

/* Where a packed legacy group's codes (nibble chunks, or Q8_0's bytes) start. */
static inline int legacy_codes_at(int type) {
    return type == T_Q4_1 ? 32 : type == T_Q5_0 ? 48 : 16;
}

/* The offset a legacy format's unsigned code carries (value = d (code - offset)). */
static inline int legacy_offset(int type) {
    return type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? 128 : 0;
}

static void repack_kquant(int type, const uint8_t *blk, uint8_t *out) {
    uint8_t q[256];
    if (type == T_Q4_K) {
        q4k_codes(blk, q);
        memcpy(out, blk, 16); /* d, dmin and the 12 bytes of packed scales, as stored */
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 32; j++)
                out[16 + 32 * c + j] = (uint8_t)(q[by32(c, j >> 2, j & 3)] |
                                                 (q[by32(c + 4, j >> 2, j & 3)] << 4));
        return;
    }
    int8_t sc[16];
    float d;
    decode_q6k(blk, q, sc, &d);
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 32; j++)
            out[32 * c + j] = (uint8_t)((q[by16(c, j >> 2, j & 3)] & 15) |
                                        ((q[by16(c + 4, j >> 2, j & 3)] & 15) << 4));
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 32; j++) {
            int v = 0;
            for (int i = 0; i < 4; i++) v |= ((q[by16(4 * h + i, j >> 2, j & 3)] >> 4) & 3) << (2 * i);
            out[128 + 32 * h + j] = (uint8_t)v;
        }
    memcpy(out + 192, blk + 192, 18);
}

/* One group of up to 8 legacy blocks (nblk of them; the rest are zero). */
static void repack_group(int type, const uint8_t *blks, int nblk, uint8_t *out) {
    int per;
    const int bb = type_block(type, &per);
    const int off = legacy_offset(type);
    uint8_t code[8][32];
    memset(out, 0, (size_t)unit_bytes(type));
    memset(code, 0, sizeof code);
    for (int l = 0; l < nblk; l++) {
        const uint8_t *blk = blks + l * bb;
        int8_t q[32];
        float d, m;
        decode_legacy(type, blk, q, &d, &m);
        for (int i = 0; i < 32; i++) code[l][i] = (uint8_t)(q[i] + off);
        memcpy(out + 2 * l, blk, 2);                          /* d */
        if (type == T_Q4_1) memcpy(out + 16 + 2 * l, blk + 2, 2); /* m */
    }
    /* register t, byte j = 4l + b: value 4t + b of block l */
#define CODE(t, j) code[(j) >> 2][4 * (t) + ((j) & 3)]
    if (type == T_Q8_0) {
        for (int t = 0; t < 8; t++)
            for (int j = 0; j < 32; j++) out[legacy_codes_at(type) + 32 * t + j] = CODE(t, j);
        return;
    }
    uint8_t *nib = out + legacy_codes_at(type);
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 32; j++)
            nib[32 * c + j] = (uint8_t)((CODE(c, j) & 15) | ((CODE(c + 4, j) & 15) << 4));
    if (type == T_Q5_0)
        for (int j = 0; j < 32; j++) {
            int v = 0;
            for (int t = 0; t < 8; t++) v |= ((CODE(t, j) >> 4) & 1) << t;
            out[16 + j] = (uint8_t)v;
        }
#undef CODE
}

/* Rows [r0, r1) of a stored [n, K] matrix into the packed layout. */
static void repack_rows(int type, const uint8_t *src, int64_t K, int64_t r0, int64_t r1,
                        uint8_t *dst) {
    int per;
    const int bb = type_block(type, &per);
    const int64_t nunits = row_units(type, K), ub = unit_bytes(type);
    const int64_t src_row = K / per * bb;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *s = src + r * src_row;
        uint8_t *o = dst + r * nunits * ub;
        if (is_kquant(type)) {
            for (int64_t u = 0; u < nunits; u++) repack_kquant(type, s + u * bb, o + u * ub);
        } else {
            const int64_t nb = K / 32;
            for (int64_t u = 0; u < nunits; u++) {
                int64_t left = nb - 8 * u;
                repack_group(type, s + 8 * u * bb, left < 8 ? (int)left : 8, o + u * ub);
            }
        }
    }
}

/* ------------------------------------------------------------ activation quantizing */
/* K-quant activations: one 256-value block, codes in the packed register order. */
typedef struct {
    /* Each permutation in its own 4 cache lines and the scalars in a fifth (576 bytes,
     * 64-aligned): a Q4_K or a Q6_K tile touches 5 lines of a block, its vector loads
     * never split a line, and a pass of 8 rows over K = 8960 keeps ~90 KB of activations
     * close instead of ~125 KB. */
    int8_t q32[256];   /* the codes by 32 (for Q4_K) */
    int8_t q16[256];   /* the codes by 16 (for Q6_K) */
    float d;
    float bs32f[8];    /* sums of the codes of values 32i .. 32i + 31 (exact as floats) */
    int16_t bsums[16]; /* sums of the codes of values 16i .. 16i + 15 */
} __attribute__((aligned(64))) xk_t;
#define XK_TILE_BYTES 320 /* of an xk_t, the bytes a tile reads: one permutation and the scalars */

/* Legacy activations: a group of 8 blocks of 32, codes in the packed register order. */
typedef struct {
    float d[8];   /* scale of block l */
    float s[8];   /* d[l] * bs[l], for the Q4_1 min term */
    int32_t bs[8]; /* sum of block l's codes */
    int8_t q[256];
} xg_t;

static void quantize_block_scalar(const float *x, int n, float *d_out, int8_t *q) {
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

#ifdef SPEC_X86
/* The same numbers as quantize_block_scalar (n a multiple of 8): the maximum of |x| is
 * exact in any order, and x * id is rounded half to even as nearbyintf does. */
__attribute__((target("avx2,fma,f16c"))) static void quantize_block_avx2(const float *x, int n,
                                                                         float *d_out, int8_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 idv = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), idv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
        const __m256i w = _mm256_cvtps_epi32(v);
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(w16, w16));
    }
    *d_out = amax / 127.0f;
}
#endif

static int resolve_path(void);

/* int8 codes of n values (a multiple of 8) and their scale: round(x * 127 / max|x|), by
 * the routine of `path` (the same numbers on every path). */
static void quantize_block(const float *x, int n, float *d_out, int8_t *q, int path) {
#ifdef SPEC_X86
    if (path >= PATH_AVX2) {
        quantize_block_avx2(x, n, d_out, q);
        return;
    }
#else
    (void)path;
#endif
    quantize_block_scalar(x, n, d_out, q);
}

/* Copies 4-byte words: dst word w = src word from[w], for the 64 words of 256 codes. */
static inline void permute_words(const int8_t *src, const uint8_t from[64], int8_t *dst) {
    for (int w = 0; w < 64; w++) memcpy(dst + 4 * w, src + 4 * from[w], 4);
}

/* Word w = 8t + l of the packed order reads word (value / 4) of the value order. */
static uint8_t g_from16[64], g_from32[64];
static void init_perms(void) {
    for (int t = 0; t < 8; t++)
        for (int l = 0; l < 8; l++) {
            g_from16[8 * t + l] = (uint8_t)(by16(t, l, 0) / 4);
            g_from32[8 * t + l] = (uint8_t)(by32(t, l, 0) / 4);
        }
}
static pthread_once_t g_perms_once = PTHREAD_ONCE_INIT;

/* (xa, where not NULL, receives each block's codes in value order) */
static void quantize_row_k(const float *x, int64_t K, xk_t *out, int8_t *xa, int path) {
    pthread_once(&g_perms_once, init_perms);
    for (int64_t b = 0; b < K / 256; b++) {
        int8_t q[256];
        quantize_block(x + b * 256, 256, &out[b].d, q, path);
        if (xa) memcpy(xa + b * 256, q, 256);
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += q[j * 16 + i];
            out[b].bsums[j] = (int16_t)sum;
        }
        for (int j = 0; j < 8; j++) out[b].bs32f[j] = (float)(out[b].bsums[2 * j] + out[b].bsums[2 * j + 1]);
        permute_words(q, g_from16, out[b].q16);
        permute_words(q, g_from32, out[b].q32);
    }
}

static void quantize_row_g(const float *x, int64_t K, xg_t *out, int path) {
    pthread_once(&g_perms_once, init_perms);
    const int64_t nb = K / 32;
    for (int64_t g = 0; g < (nb + 7) / 8; g++) {
        xg_t *o = out + g;
        int8_t q[256];
        memset(o, 0, sizeof *o);
        memset(q, 0, sizeof q);
        for (int l = 0; l < 8 && 8 * g + l < nb; l++) {
            quantize_block(x + 32 * (8 * g + l), 32, &o->d[l], q + 32 * l, path);
            int sum = 0;
            for (int i = 0; i < 32; i++) sum += q[32 * l + i];
            o->bs[l] = sum;
            o->s[l] = o->d[l] * (float)sum;
        }
        permute_words(q, g_from32, o->q); /* block l's value 4t + b is value 32l + 4t + b */
    }
}

/* The fixed order in which 8 float lane accumulators are added. */
static inline float hsum8(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* ------------------------------------------------------------------ the job layout */
typedef struct {
    int type;
    const uint8_t *w; /* packed rows of row_bytes */
    int64_t n;        /* output columns of this part */
    int64_t col0;     /* first output column in y */
    int64_t row_bytes;
    int64_t unit_bytes;
} part_t;

typedef struct {
    int nparts;
    part_t parts[MAX_PARTS];
    int64_t K, m, ldy;
    int64_t nk, ng;  /* K-quant blocks and legacy groups per row */
    const xk_t *xk;  /* [m][nk] or NULL */
    const xg_t *xg;  /* [m][ng] or NULL */
    const int8_t *xa; /* [m rounded up to 16][nk][256] the codes in value order (AMX tiles) or NULL */
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
/* The 8 registers of a packed unit as unsigned codes, register t at reg[32 t ...]. */
static void unpack_unit(int type, const uint8_t *u, uint8_t reg[256]) {
    if (type == T_Q8_0) {
        memcpy(reg, u + legacy_codes_at(type), 256);
        return;
    }
    const uint8_t *nib = type == T_Q4_K ? u + 16 : type == T_Q6_K ? u : u + legacy_codes_at(type);
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 32; j++) {
            reg[32 * c + j] = nib[32 * c + j] & 15;
            reg[32 * (c + 4) + j] = nib[32 * c + j] >> 4;
        }
    if (type == T_Q6_K)
        for (int t = 0; t < 8; t++)
            for (int j = 0; j < 32; j++)
                reg[32 * t + j] |= (uint8_t)(((u[128 + 32 * (t >> 2) + j] >> (2 * (t & 3))) & 3) << 4);
    if (type == T_Q5_0)
        for (int t = 0; t < 8; t++)
            for (int j = 0; j < 32; j++) reg[32 * t + j] |= (uint8_t)(((u[16 + j] >> t) & 1) << 4);
}

/* Lane sums over registers 0-3 (lo) and 4-7 (hi): what the vector paths' two
 * accumulators hold. */
static void lane_dots(const uint8_t reg[256], const int8_t *x, int32_t lo[8], int32_t hi[8]) {
    for (int l = 0; l < 8; l++) {
        lo[l] = 0;
        hi[l] = 0;
    }
    for (int t = 0; t < 8; t++)
        for (int l = 0; l < 8; l++) {
            int32_t s = 0;
            for (int b = 0; b < 4; b++) s += (int32_t)reg[32 * t + 4 * l + b] * x[32 * t + 4 * l + b];
            if (t < 4)
                lo[l] += s;
            else
                hi[l] += s;
        }
}

/* The float steps of one (row, column, unit), the same on every path: fused
 * multiply-adds (fmaf here, vfmadd in the vector code: one rounding either way). */
static void cols_portable(const job_t *jb, const part_t *p, int64_t c0, int64_t c1) {
    const int type = p->type, kq = is_kquant(type);
    const int64_t nu = kq ? jb->nk : jb->ng;
    for (int64_t c = c0; c < c1; c++) {
        const uint8_t *row = p->w + c * p->row_bytes;
        for (int64_t r0 = 0; r0 < jb->m; r0 += MAX_ROWS_TILE) {
            const int64_t R = jb->m - r0 < MAX_ROWS_TILE ? jb->m - r0 : MAX_ROWS_TILE;
            float acc[MAX_ROWS_TILE][8];
            memset(acc, 0, sizeof acc);
            for (int64_t u = 0; u < nu; u++) {
                const uint8_t *unit = row + u * p->unit_bytes;
                uint8_t reg[256];
                unpack_unit(type, unit, reg);
                uint64_t sc8 = 0, mn8 = 0; /* Q4_K's scales and mins, a byte each */
                if (type == T_Q4_K) q4k_scales8(unit + 4, &sc8, &mn8);
                for (int64_t r = 0; r < R; r++) {
                    int32_t lo[8], hi[8];
                    if (type == T_Q4_K) {
                        const xk_t *xb = jb->xk + (r0 + r) * nu + u;
                        lane_dots(reg, xb->q32, lo, hi);
                        const float d = h2f(rd16(unit)), dmin = h2f(rd16(unit + 2));
                        for (int l = 0; l < 8; l++) {
                            /* d sc and dmin mn are exact (11-bit halves times 6-bit
                             * integers), as are the sums as floats: v is the one rounding
                             * of (lo + hi) sc d - bs32 mn dmin, and the vector paths form
                             * d sc and dmin mn once for all the rows of a tile */
                            const float dsc = d * (float)(uint8_t)(sc8 >> (8 * l));
                            const float ndmn = -(dmin * (float)(uint8_t)(mn8 >> (8 * l)));
                            float v = fmaf(xb->bs32f[l], ndmn, (float)(lo[l] + hi[l]) * dsc);
                            acc[r][l] = fmaf(v, xb->d, acc[r][l]);
                        }
                    } else if (type == T_Q6_K) {
                        const xk_t *xb = jb->xk + (r0 + r) * nu + u;
                        const int8_t *sc = (const int8_t *)(unit + 192);
                        lane_dots(reg, xb->q16, lo, hi);
                        const float d = h2f(rd16(unit + 208));
                        for (int l = 0; l < 8; l++) {
                            int32_t s = sc[l] * lo[l] + sc[8 + l] * hi[l] -
                                        32 * (sc[2 * l] * xb->bsums[2 * l] +
                                              sc[2 * l + 1] * xb->bsums[2 * l + 1]);
                            acc[r][l] = fmaf((float)s * d, xb->d, acc[r][l]);
                        }
                    } else {
                        const xg_t *xb = jb->xg + (r0 + r) * nu + u;
                        const int off = legacy_offset(type);
                        lane_dots(reg, xb->q, lo, hi);
                        for (int l = 0; l < 8; l++) {
                            int32_t s = lo[l] + hi[l] - off * xb->bs[l];
                            float f = h2f(rd16(unit + 2 * l)) * xb->d[l];
                            acc[r][l] = fmaf((float)s, f, acc[r][l]);
                            if (type == T_Q4_1)
                                acc[r][l] = fmaf(h2f(rd16(unit + 16 + 2 * l)), xb->s[l], acc[r][l]);
                        }
                    }
                }
            }
            for (int64_t r = 0; r < R; r++) jb->y[(r0 + r) * jb->ldy + p->col0 + c] = hsum8(acc[r]);
        }
    }
}

/* ------------------------------------------------------------------ vector kernels */
typedef void (*tile_fn)(const job_t *, const part_t *, int64_t, int64_t);
/* a one-column K-quant tile over blocks [u0, u1) of a column, its sums carried in memory */
typedef void (*span_fn)(const job_t *, const part_t *, int64_t, int64_t, int64_t, int64_t, float *);
/* one instruction set's tiles: fn[format][R - 1][C - 1] */
typedef struct {
    int cols; /* the most columns a tile takes */
    int rows; /* the most rows a one-column tile takes */
    tile_fn fn[6][MAX_ROWS_TILE][2];
    span_fn span[2][MAX_ROWS_TILE]; /* [Q6_K][R - 1] */
    span_fn span2[2][MANY_ROWS_TILE]; /* [Q6_K][R - 1]: tiles of `cols` columns */
} tile_set;

static inline int kind_of(int type) {
    switch (type) {
    case T_Q4_0: return 0;
    case T_Q4_1: return 1;
    case T_Q5_0: return 2;
    case T_Q8_0: return 3;
    case T_Q4_K: return 4;
    default: return 5; /* Q6_K */
    }
}

/* Weight prefetch, for tiles of at least g_prefetch_rows rows: each tile asks for the
 * lines g_prefetch_bytes past every weight unit it reads (a chunk's columns are
 * contiguous, so this runs on into the next columns; 0: no software prefetch). Measured
 * on a Zen 4 EPYC, all the 1.5B's matrices, interleaved with the former prefetch (whole
 * columns 2 KiB ahead, for passes of 5+ rows only): 1 row 0.98x, 2 rows 0.89x, 4 rows
 * 0.87x, 8 rows 0.87x, 16 rows 0.70x of its time; the FFN's down projection (5 KiB
 * columns) at 8 rows 0.74x. */
static int g_prefetch_rows = 1;
static int g_prefetch_bytes = 2048;
/* ... and, in passes of at most g_prefetch_l2_rows rows (a decode step, a verify pass: the
 * weights stream from memory once; a prefill chunk's tiles find them in L2), the lines
 * g_prefetch_l2_bytes past those into L2 (_MM_HINT_T1; 0: not). A core has few L1 fill
 * buffers; asking L2 for the weights well ahead lets more of the stream be in flight, so
 * that the L1 prefetch finds its lines in L2. -1 (the default): resolved by features(),
 * on Intel CPUs only (measured there, PREFETCH_L2_INTEL); elsewhere 0. On a Xeon (Emerald
 * Rapids kind), whole passes of the 1.5B with it against without: 1 row 0.87-0.88x, 2
 * rows 0.92-0.95x, 4 rows 0.87-0.94x, 8 rows 0.98-1.02x (noise); 2 or 8 KiB past instead
 * of 4: within noise; passes of up to 8 rows against up to 4: 5 rows 0.93x, 6 rows 0.95x.
 * Keys and values of attention asked into L2 a block or more ahead: 1.02-1.04x (not
 * kept). */
static int g_prefetch_l2_bytes = -1;
static int g_prefetch_l2_rows = 8;
#define PREFETCH_L2_INTEL 4096
/* the L2 distance (past the L1 one, pfd) for a pass's tiles: 0 where pfd is 0 or the pass
 * has more rows than g_prefetch_l2_rows */
static inline int64_t prefetch_l2_for(const job_t *jb, int64_t pfd) {
    return pfd && jb->m <= g_prefetch_l2_rows ? g_prefetch_l2_bytes : 0;
}
/* the prefetches of a tile of weight units of ub bytes at b, pfd / pf2 as above */
#define PREFETCH_UNIT(b, ub, pfd, pf2)                                                            \
    do {                                                                                          \
        for (int64_t o_ = 0; o_ < (ub); o_ += 64) {                                               \
            _mm_prefetch((const char *)(b) + (pfd) + o_, _MM_HINT_T0);                            \
            if (pf2) _mm_prefetch((const char *)(b) + (pfd) + (pf2) + o_, _MM_HINT_T1);           \
        }                                                                                         \
    } while (0)
/* Spans (spans_run): blocks a span takes (0: none), columns taken together, and how many
 * pieces ahead the weights are asked for. */
static int g_span_blocks = 4;
static int g_span_cols = 8;
static int g_span_ahead = 2;
#define SPAN_MAX_COLS 32
#define SPAN_ACT_BYTES (24 * 1024) /* a pass's activations of a column past this take spans */
/* attention of several rows: the most pairs of rows a task takes (attend_rows; 0: one row
 * at a time), every pair over the same keys and values while they are in L1. A pass of T
 * rows takes T / 32 pairs a task (at least 1), so short passes keep a task per pair for
 * the threads to share: on a Xeon (Emerald Rapids kind) 256 rows over 1k-4k keys took
 * 0.78-0.84x of the time in blocks of 8 pairs as in pairs, 8 rows 1.05-1.11x. */
static int g_attn_pairs = 8;
/* ... unless the cache is long: from this many keys a pass's rows are spread so that
 * each group's rows make as few tasks as keep every thread busy (all of them on 2 threads
 * with 2 key/value groups), each reading the keys and values once instead of once per
 * pair. On a Xeon (Emerald Rapids kind) whole passes of 4-16 rows after 2k-4k tokens
 * took 0.95-0.97x of the time, after 512-1k tokens 0.97-1.03x. */
static int g_attn_long_keys = 1024;
#define ATTN_MAX_PAIRS 8
/* attention's scores and weighted values in 512-bit registers on the AVX-512 paths
 * (scores_one_512, values_one_512, ...; the same bits as the 256-bit code): on a Xeon
 * (Emerald Rapids kind) the weighted values alone made attention 0.84-0.89x of the time
 * at 2-256 rows, both 0.72-0.85x */
static int g_attn_512 = 1;
/* kq_wide's two-column K-quant tiles on the VNNI path: 1 on, 0 off, -1 (the default) on
 * Intel CPUs only (resolved by features()). Measured on a Xeon (Emerald Rapids kind),
 * the 1.5B's passes interleaved off and on: 4 rows 0.92x, 8 rows 0.84x, 16 rows 0.77x,
 * 64 rows 0.80x of the time. */
static int g_wide_tiles = -1;
static int g_wide_rows = 8; /* rows of a kq_wide tile, 1..WIDE_ROWS */
/* AMX tiles for prefill's matmuls (amx_run): 0 off, 1 Q4_K's (the default where the CPU
 * has them), 2 Q6_K's too (a 1,170-token prefill measured no faster: 0.70x against
 * 0.66x of the time without tiles, within this Xeon's noise) */
static int g_amx_tiles = -1;
/* the fewest rows of a pass that takes kq_wide (fewer keep kq_tile's one-column tiles).
 * On a Xeon (Emerald Rapids kind) with the L2 prefetch, whole passes of the 1.5B, every
 * pass on kq_wide against from 3 rows: 1 row 0.968-0.984x, 2 rows 0.958-0.987x (three
 * runs); before the L2 prefetch, 2 rows 1.02x, 3 rows 0.96x. */
static int g_wide_min_rows = 1;

/* Threads take chunks of about columns / (threads x g_chunks_per_thread) columns, at most
 * g_max_chunk_cols: long runs of contiguous weights for each core's stream. */
static int g_chunks_per_thread = 8;
static int g_max_chunk_cols = 512;
static int g_rows_outer = 12288; /* rows_outer_run's L1 budget in bytes; 0: off */
#define WIDE_ROWS 8             /* the most rows of a kq_wide tile */

/* Per-thread buffers kept from one call to the next (grown as needed; NULL when that
 * fails), freed as a pool worker ends: attention's scores, the AMX tiles' column
 * layouts, and a float16 cache's keys and values widened a block at a time. 64-byte
 * aligned. */
typedef struct {
    void *p;
    int64_t bytes;
} scratch_t;
static __thread scratch_t t_attn_scratch, t_amx_scratch, t_kv_scratch;
static void *scratch_get(scratch_t *s, int64_t bytes) {
    if (bytes > s->bytes) {
        free(s->p);
        s->p = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        s->bytes = s->p ? bytes : 0;
    }
    return s->p;
}
static void scratch_free(void) {
    scratch_t *all[] = {&t_attn_scratch, &t_amx_scratch, &t_kv_scratch};
    for (int i = 0; i < 3; i++) {
        free(all[i]->p);
        all[i]->p = NULL;
        all[i]->bytes = 0;
    }
}

#define AMX_MIN_ROWS 32 /* a pass's columns are laid out for the tiles once, which fewer rows
                         * share: on a Xeon the 1.5B's whole passes after a 64-token context
                         * took 1.02x the time at 16 and 24 rows, 0.92x at 32, 0.84x at 48
                         * (one 8960 x 1536 matrix: 16 rows 0.95x, 32 rows 0.76x) */
static int features(void);
/* whether a pass of m rows takes amx_run for its parts of this format (Q4_K's, Q6_K's too
 * with amx_tiles=2) */
static inline int amx_for(int type, int path, int64_t m) {
    return (type == T_Q4_K || (type == T_Q6_K && g_amx_tiles > 1)) && g_amx_tiles > 0 &&
           (features() & FEAT_AMX) && path == PATH_AVX512VNNI && m >= AMX_MIN_ROWS && g_rows_outer;
}

#ifdef SPEC_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float hsum8_avx(__m256 a) {
    /* ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), as hsum8 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s)); /* (s0+s2, s1+s3) */
    return _mm_cvtss_f32(t) + _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1));
}

#define TL_ATTR AVX2
#define TL_FN(name) name##_avx2
#define TL_ROWS 4
#define TL_VNNI 0
#define TL_COLS 1
#define TL_PIN(v) __asm__("" : "+x"(v))
#include "tiles.h"

#define TL_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define TL_FN(name) name##_avx512
#define TL_ROWS 8
#define TL_VNNI 0
#define TL_COLS 2
#define TL_PIN(v) __asm__("" : "+v"(v))
#include "tiles.h"

#define TL_ATTR                                                                                  \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define TL_FN(name) name##_vnni
#define TL_ROWS 8
#define TL_VNNI 1
#define TL_COLS 2
#define TL_PIN(v) __asm__("" : "+v"(v))
#include "tiles.h"

/* A K-quant tile of R rows (1..WIDE_ROWS) by two columns in 512-bit registers, for
 * decode steps and verify passes of up to 8 rows (cols_run, spans_run; g_wide_min_rows)
 * and prefills (rows_outer_run). Each code register of kq_tile (32 bytes, "ch") becomes a 512-bit one holding column c's
 * codes in its low half and column c + 1's in its high half, and the row's 32
 * activation bytes go to both halves, so one vpdpbusd does the work of two of
 * kq_tile's and lanes 0-7 sum column c's groups, lanes 8-15 column c + 1's: the exact
 * integers kq_tile sums. The scale step then runs both columns' 8 lanes at once, each
 * lane the same integer and float operations as kq_tile's, so the results are its
 * bits. On an Intel core a 512-bit vpdpbusd costs about what a 256-bit one does; Zen 4
 * splits it in two (see g_wide_tiles). */
#define VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define AVX512F __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))

/* float16 <-> float32 with F16C (n a multiple of 8): the same values as h2f and f2h */
AVX2 static void kv_widen_f16c(const uint16_t *s, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
}
AVX512F static void kv_widen_f16c512(const uint16_t *s, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
    if (i < n) kv_widen_f16c(s + i, n - i, dst + i);
}
AVX2 static void kv_narrow_f16c(const float *s, int64_t n, uint16_t *dst) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* hsum8 of 16 groups of 8 lanes at once (t[k] lanes 0-7 one group, 8-15 another): lanes l
 * and l + 4 of two registers side by side, then l and l + 2, then l and l + 1, which is
 * hsum8's tree exactly, 21 shuffles and adds where hsum8 of each takes about 6
 * instructions. Group g of t[k] (g = 0: lanes 0-7) ends in lane 8 (k & 1) + 4 g + k / 2. */
AVX512F __attribute__((always_inline)) static inline __m512 hsum8_x16(const __m512 t[8]) {
    __m512 u[4], v[2];
    for (int k = 0; k < 4; k++) /* (t0 + t4, t1 + t5, t2 + t6, t3 + t7) per group, a quarter each */
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++) /* (t0 + t4) + (t2 + t6), (t1 + t5) + (t3 + t7) */
        v[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}
VNNI512 static inline __m512i two_halves(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
VNNI512 static inline __m512 two_f16(const uint8_t *a, const uint8_t *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtph_ps(_mm_set1_epi16((short)rd16(a)))),
                              _mm256_cvtph_ps(_mm_set1_epi16((short)rd16(b))), 1);
}
VNNI512 static inline __m512i both_halves(const void *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}
VNNI512 static inline __m512i q6_high512(__m512i h, const int ch, __m512i m30) {
    const __m512i s = ch == 0   ? _mm512_slli_epi16(h, 4)
                      : ch == 1 ? _mm512_slli_epi16(h, 2)
                      : ch == 2 ? h
                                : _mm512_srli_epi16(h, 2);
    return _mm512_and_si512(s, m30);
}
VNNI512 __attribute__((always_inline)) static inline void
kq_wide(const job_t *jb, const part_t *p, int64_t r0, const int R, int64_t c, const int q6,
        const int64_t u0, const int64_t u1, float *carry) {
    const int64_t nu = jb->nk, ub = p->unit_bytes;
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const uint8_t *w0 = p->w + c * p->row_bytes, *w1 = w0 + p->row_bytes;
    const xk_t *xrow[WIDE_ROWS];
    for (int r = 0; r < R; r++) xrow[r] = jb->xk + (r0 + r) * nu;
    /* lanes 0-7: column c's 8 sums, lanes 8-15: column c + 1's (kq_tile's carry layout
     * [R][2][8]) */
    __m512 acc[WIDE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = u0 ? _mm512_loadu_ps(carry + 16 * r) : _mm512_setzero_ps();
    const int64_t pfd = !carry && R >= g_prefetch_rows ? g_prefetch_bytes : 0;
    const int64_t pf2 = prefetch_l2_for(jb, pfd);
    for (int64_t u = u0; u < u1; u++) {
        const uint8_t *b0 = w0 + u * ub, *b1 = w1 + u * ub;
        if (pfd) {
            PREFETCH_UNIT(b0, ub, pfd, pf2);
            PREFETCH_UNIT(b1, ub, pfd, pf2);
        }
        __m512i lo[4], hi[4];
        for (int ch = 0; ch < 4; ch++) {
            const int at = (q6 ? 0 : 16) + 32 * ch;
            const __m512i q = two_halves(b0 + at, b1 + at);
            lo[ch] = _mm512_and_si512(q, m4);
            hi[ch] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            if (q6) { /* bits 2ch, 2ch+1 of each byte -> bits 4, 5, as kq_tile's q6_high */
                const __m512i h0 = two_halves(b0 + 128, b1 + 128), h1 = two_halves(b0 + 160, b1 + 160);
                lo[ch] = _mm512_or_si512(lo[ch], q6_high512(h0, ch, m30));
                hi[ch] = _mm512_or_si512(hi[ch], q6_high512(h1, ch, m30));
            }
        }
        if (q6) {
            /* kq_tile's scA, scB and sc16, column c in the low half, c + 1 in the high */
            const __m128i s0 = _mm_loadu_si128((const __m128i *)(b0 + 192));
            const __m128i s1 = _mm_loadu_si128((const __m128i *)(b1 + 192));
            const __m512i scA = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(s0, s1));
            const __m512i scB = _mm512_cvtepi8_epi32(_mm_unpackhi_epi64(s0, s1));
            const __m512i sc16 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepi8_epi16(s0)),
                                                    _mm256_cvtepi8_epi16(s1), 1);
            const __m512 d = two_f16(b0 + 208, b1 + 208);
            /* the integer sums a register of codes at a time for every row (not a row's
             * 8 vpdpbusd in a row, one chain waiting on the last): R independent chains
             * (exact integers, in any order the same) */
            __m512i A[WIDE_ROWS], B[WIDE_ROWS];
            for (int r = 0; r < R; r++) A[r] = B[r] = _mm512_setzero_si512();
            for (int ch = 0; ch < 4; ch++)
                for (int r = 0; r < R; r++) {
                    const xk_t *xb = xrow[r] + u;
                    A[r] = _mm512_dpbusd_epi32(A[r], lo[ch], both_halves(xb->q16 + 32 * ch));
                    B[r] = _mm512_dpbusd_epi32(B[r], hi[ch], both_halves(xb->q16 + 32 * (ch + 4)));
                }
            for (int r = 0; r < R; r++) {
                const xk_t *xb = xrow[r] + u;
                const __m512i bs = _mm512_madd_epi16(both_halves(xb->bsums), sc16);
                __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(A[r], scA), _mm512_mullo_epi32(B[r], scB));
                sum = _mm512_sub_epi32(sum, _mm512_slli_epi32(bs, 5));
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), d), _mm512_set1_ps(xb->d), acc[r]);
            }
        } else {
            uint64_t sc0, mn0, sc1, mn1;
            q4k_scales8(b0 + 4, &sc0, &mn0);
            q4k_scales8(b1 + 4, &sc1, &mn1);
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)sc1, (long long)sc0));
            const __m512i mn = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)mn1, (long long)mn0));
            const __m512 dsc = _mm512_mul_ps(two_f16(b0, b1), _mm512_cvtepi32_ps(sc));
            const __m512 dmn = _mm512_mul_ps(two_f16(b0 + 2, b1 + 2), _mm512_cvtepi32_ps(mn));
            __m512i A[WIDE_ROWS]; /* as Q6_K's, every row's sums a register at a time */
            for (int r = 0; r < R; r++) A[r] = _mm512_setzero_si512();
            for (int ch = 0; ch < 4; ch++)
                for (int r = 0; r < R; r++) {
                    const xk_t *xb = xrow[r] + u;
                    A[r] = _mm512_dpbusd_epi32(A[r], lo[ch], both_halves(xb->q32 + 32 * ch));
                    A[r] = _mm512_dpbusd_epi32(A[r], hi[ch], both_halves(xb->q32 + 32 * (ch + 4)));
                }
            for (int r = 0; r < R; r++) {
                const xk_t *xb = xrow[r] + u;
                const __m512i a = A[r];
                const __m512 bs = _mm512_castsi512_ps(both_halves(xb->bs32f));
                const __m512 v = _mm512_fnmadd_ps(bs, dmn, _mm512_mul_ps(_mm512_cvtepi32_ps(a), dsc));
                acc[r] = _mm512_fmadd_ps(v, _mm512_set1_ps(xb->d), acc[r]);
            }
        }
    }
    if (u1 < nu) {
        for (int r = 0; r < R; r++) _mm512_storeu_ps(carry + 16 * r, acc[r]);
        return;
    }
    if (R < 3) {
        for (int r = 0; r < R; r++) {
            float *y = jb->y + (r0 + r) * jb->ldy + p->col0 + c;
            y[0] = hsum8_avx(_mm512_castps512_ps256(acc[r]));
            y[1] = hsum8_avx(_mm512_extractf32x8_ps(acc[r], 1));
        }
        return;
    }
    /* 3 rows or more: every (row, column)'s 8 lanes at once (hsum8_x16; rows past R as
     * zeros), then one permutation into row order: (row r, column c + col) comes out in
     * lane 8 (r & 1) + 4 col + r / 2 */
    _Static_assert(WIDE_ROWS == 8, "hsum8_x16 takes 8 rows");
    for (int r = R; r < 8; r++) acc[r] = _mm512_setzero_ps();
    const __m512 w = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                           hsum8_x16(acc));
    float sums[16];
    _mm512_storeu_ps(sums, w); /* row r's two columns at 2r, 2r + 1 */
    for (int r = 0; r < R; r++) {
        float *y = jb->y + (r0 + r) * jb->ldy + p->col0 + c;
        y[0] = sums[2 * r];
        y[1] = sums[2 * r + 1];
    }
}
#define KQW(kind, q6, R)                                                                        \
    VNNI512 static void kq_wide_##kind##_##R(const job_t *j, const part_t *p, int64_t r0,       \
                                             int64_t c, int64_t u0, int64_t u1, float *cy) {    \
        kq_wide(j, p, r0, R, c, q6, u0, u1, cy);                                                \
    }
#define KQW_ALL(kind, q6)                                                                       \
    KQW(kind, q6, 1) KQW(kind, q6, 2) KQW(kind, q6, 3) KQW(kind, q6, 4)                         \
    KQW(kind, q6, 5) KQW(kind, q6, 6) KQW(kind, q6, 7) KQW(kind, q6, 8)
KQW_ALL(q4k, 0)
KQW_ALL(q6k, 1)
#define KQW_ROW(kind)                                                                           \
    {kq_wide_##kind##_1, kq_wide_##kind##_2, kq_wide_##kind##_3, kq_wide_##kind##_4,            \
     kq_wide_##kind##_5, kq_wide_##kind##_6, kq_wide_##kind##_7, kq_wide_##kind##_8}
static const span_fn kq_wide_fn[2][WIDE_ROWS] = {KQW_ROW(q4k), KQW_ROW(q6k)}; /* [Q6_K][R - 1] */
/* whether a K-quant pass of m rows on tile set ts takes kq_wide's tiles */
static inline int wide_for(const tile_set *ts, int64_t m) {
    return g_wide_tiles > 0 && ts == &tiles_vnni && m >= g_wide_min_rows;
}
#undef KQW
#undef KQW_ALL
#undef KQW_ROW

/* Columns [c0, c1) of a pass of a few rows over long K-quant columns, whose rows'
 * activations would not stay in L1 over a whole column (at 8 rows a column of the 1.5B's
 * FFN down projection has ~90 KB of them, read again for every column): the columns go in
 * groups of g_span_cols, and a group a span of g_span_blocks blocks at a time, every
 * column of the group over one span before the next span, so that the span's activations
 * stay in L1. The weights then arrive in pieces that the tiles' own prefetch (2 KiB on in
 * the same column) would miss, so the piece visited g_span_ahead pieces later is asked
 * for instead. Each (row, column) adds the same terms in the same order, its sums carried
 * between spans in memory: bitwise the result of whole columns. Measured on a Zen 4 EPYC
 * (the 1.5B's down projections, interleaved with whole columns): 3 rows 0.85x, 4 rows
 * 0.84-0.90x, 6 rows 0.86x, 8 rows 0.79-0.83x of the time. */
static void spans_run(const job_t *jb, const part_t *p, int64_t c0, int64_t c1, const tile_set *ts) {
    const span_fn f = ts->span[p->type == T_Q6_K][jb->m - 1];
    const int wide = wide_for(ts, jb->m);
    const span_fn fw = kq_wide_fn[p->type == T_Q6_K][jb->m - 1];
    const int64_t S = g_span_blocks, nk = jb->nk, nspans = (nk + S - 1) / S;
    const int64_t G = g_span_cols < SPAN_MAX_COLS ? g_span_cols : SPAN_MAX_COLS;
    float carry[SPAN_MAX_COLS * MAX_ROWS_TILE * 8] __attribute__((aligned(32)));
    for (int64_t g0 = c0; g0 < c1; g0 += G) {
        const int64_t g1 = g0 + G < c1 ? g0 + G : c1, n = g1 - g0;
        for (int64_t s = 0; s < nspans; s++) {
            const int64_t u0 = s * S, u1 = u0 + S < nk ? u0 + S : nk;
            for (int64_t c = g0; c < g1;) {
                const int pair = wide && c + 1 < g1; /* columns c and c + 1 in one kq_wide tile */
                for (int64_t cc = c; cc <= c + pair; cc++) {
                    /* piece i of the group's visiting order (span i / n, column g0 + i % n);
                     * past the group's last, the next group's first span */
                    const int64_t i = s * n + (cc - g0) + g_span_ahead;
                    const int64_t ps = i < nspans * n ? i / n : 0;
                    const int64_t pc = i < nspans * n ? g0 + i % n : g1 + (i - nspans * n);
                    if (g_span_ahead && pc < c1) {
                        const int64_t b0 = ps * S, b1 = b0 + S < nk ? b0 + S : nk;
                        const char *w = (const char *)(p->w + pc * p->row_bytes + b0 * p->unit_bytes);
                        for (int64_t o = 0; o < (b1 - b0) * p->unit_bytes; o += 64) _mm_prefetch(w + o, _MM_HINT_T0);
                    }
                }
                /* a pair's carry [m][2][8] fits the two columns' [MAX_ROWS_TILE][8] each */
                (pair ? fw : f)(jb, p, 0, c, u0, u1, carry + (c - g0) * MAX_ROWS_TILE * 8);
                c += 1 + pair;
            }
        }
    }
}

/* Columns [c0, c1) of a pass of many rows (a prefill chunk), row tiles outside the
 * column loop: a tile's rows' activations stay in L1 while the chunk's columns (their
 * weights within L2: see spec_linear) pass over them. Where a tile's activations for a
 * whole column would pass g_rows_outer bytes (the 1.5B's FFN down projection: 4 rows x
 * 35 blocks, ~45 KB), the columns go a span of blocks at a time, their sums carried
 * between spans (kq_tile's carry), up to RO_COLS columns at once. Each (row, column)
 * adds the same terms in the same order as in cols_run: the same bits. Measured on a
 * Zen 4 EPYC, interleaved with cols_run's order (every matrix of the 1.5B but the LM
 * head): 24 rows 0.86x, 32 rows 0.90x, 64 rows 0.90-0.91x, 256 rows 0.95x (its down
 * projections 0.85-0.86x with spans of 6-9 blocks); a 1,170-token prefill 0.93-0.95x.
 * Up to 16 rows it gains nothing (9 rows: 1.10x slower), so passes of fewer rows keep
 * cols_run's order; the legacy formats' tiles (the 0.5B's Q5_0 / Q8_0 matrices) measured
 * 1.04-1.09x slower this way at 16-256 rows, so they keep it too (K-quants only). */
#define RO_COLS 64     /* columns whose sums a span carries at once */
#define RO_MIN_ROWS 16 /* the fewest rows that take rows_outer_run */
static void rows_outer_run(const job_t *jb, const part_t *p, int64_t c0, int64_t c1, const tile_set *ts,
                           const int kind, const int cols) {
    const int wide = wide_for(ts, jb->m); /* K-quants only come here */
    const int64_t nk = jb->nk, tr = wide ? g_wide_rows : MANY_ROWS_TILE, ntiles = (jb->m + tr - 1) / tr;
    int64_t S = nk;
    /* the budget is for 4 rows' activations: kq_wide's tiles of 8 rows take spans as long
     * as 4-row tiles do, twice the bytes, which Intel's 48 KiB L1 holds (on a Xeon, 16-row
     * passes 0.81x and 64-row passes 0.89x of the time of spans sized for 8 rows) */
    if (nk * XK_TILE_BYTES * MANY_ROWS_TILE > g_rows_outer) {
        S = g_rows_outer / (XK_TILE_BYTES * MANY_ROWS_TILE);
        if (S < 1) S = 1;
    }
    const int64_t nspans = (nk + S - 1) / S;
    float carry[RO_COLS * WIDE_ROWS * 8] __attribute__((aligned(32)));
    for (int64_t g0 = c0; g0 < c1; g0 += RO_COLS) {
        const int64_t g1 = g0 + RO_COLS < c1 ? g0 + RO_COLS : c1;
        for (int64_t t = 0; t < ntiles; t++) {
            const int64_t r0 = jb->m * t / ntiles, R = jb->m * (t + 1) / ntiles - r0;
            for (int64_t s = 0; s < nspans; s++) {
                const int64_t u0 = s * S, u1 = u0 + S < nk ? u0 + S : nk;
                for (int64_t c = g0; c < g1;) {
                    const int C = g1 - c >= cols ? cols : 1, q6 = p->type == T_Q6_K;
                    float *cy = carry + (c - g0) * tr * 8;
                    if (wide && C == 2)
                        kq_wide_fn[q6][R - 1](jb, p, r0, c, u0, u1, nspans == 1 ? NULL : cy);
                    else if (nspans == 1)
                        ts->fn[kind][R - 1][C - 1](jb, p, r0, c);
                    else if (C == 1)
                        ts->span[q6][R - 1](jb, p, r0, c, u0, u1, cy);
                    else
                        ts->span2[q6][R - 1](jb, p, r0, c, u0, u1, cy);
                    c += C;
                }
            }
        }
    }
}

_Static_assert(AMX_MIN_ROWS >= RO_MIN_ROWS, "the AMX tiles are taken in rows_outer_run's place");

/* Prefill's Q4_K matmuls on AMX tiles (and Q6_K's with amx_tiles=2, below): a tile
 * multiply-add of 16 rows' activations by 16 columns' codes over one 32-value sub-block
 * gives the 16 x 16 integer sums kq_tile's
 * vpdpbusd lanes form (exact integers, in any order), and each sum then takes kq_tile's
 * own float step (times d * scale, less the row's code sum times dmin * min, times the
 * row's scale, added to that sub-block's accumulator, blocks in order) and the 8
 * sub-blocks' accumulators are added in hsum8's order: the bits of every other path.
 * The float step, one per (row, column, sub-block), is most of the work; the multiplies
 * cost next to nothing, against 4 vpdpbusd per row and block on the VNNI tiles.
 * Columns go 16 at a time: their codes are laid out once per pass as the tiles read
 * them (8 rows of 16 columns' 4 codes per sub-block), with their scales, in a scratch of
 * this thread's; a pass's columns that do not fill 16 take rows_outer_run. Activations
 * come as their codes in value order, [rows rounded up to 16][nk][256] (jb->xa), so that
 * a tile of 16 rows of a sub-block is one strided load. */
#ifdef SPEC_AMX
#define AMXF __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;
#define AMX_SUB_BYTES 512 /* one sub-block's codes of 16 columns: 8 rows x 16 columns x 4 */
/* A column group's scales in the scratch, after its codes (4 KiB a block): Q4_K d * scale
 * and dmin * min; Q6_K scales l and l + 8, the pair 2l, 2l + 1, and d. [nk][8][16] each
 * but d ([nk][16]). */
typedef struct {
    float *dsc, *dmn;
    int32_t *sc_l, *sc_h, *sc_pair;
    float *d;
} amx_scales_t;

/* r[i] <- word i of every r[j] (an 8 x 8 transpose of 32-bit words): r[i] word j is then
 * the old r[j] word i */
AMXF static inline void transpose8_words(__m256i r[8]) {
    __m256i t[8], q[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        q[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        q[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        q[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        q[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(q[i], q[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(q[i], q[i + 4], 0x31);
    }
}

/* Columns c .. c + 15's codes and scales over nk blocks, as amx_tiles reads them:
 * codes [nk][8 sub-blocks][8][16][4] (row t of sub-block l: value 4t .. 4t + 3 of it,
 * which the repacked unit holds in word l of its register t: the low nibbles of register
 * t < 4, the high ones of register t - 4), then d * scale and dmin * min [nk][8][16]. */
AMXF static void amx_q4k_columns(const part_t *p, int64_t c, int64_t nk, uint8_t *codes,
                                 const amx_scales_t *sc) {
    float *dsc = sc->dsc, *dmn = sc->dmn;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int64_t u = 0; u < nk; u++) { /* a block's 4 KiB of codes in L1 while its columns come */
        uint8_t *o = codes + u * 8 * AMX_SUB_BYTES;
        for (int h = 0; h < 2; h++) { /* columns c + 8h .. c + 8h + 7 */
            const uint8_t *b[8];
            __m256i ds[8], dm[8];
            for (int i = 0; i < 8; i++) {
                b[i] = p->w + (c + 8 * h + i) * p->row_bytes + u * p->unit_bytes;
                uint64_t sc8, mn8;
                q4k_scales8(b[i] + 4, &sc8, &mn8);
                /* lane l: d * scale l and dmin * min l, each one rounding of exact values */
                ds[i] = _mm256_castps_si256(_mm256_mul_ps(
                    _mm256_set1_ps(h2f(rd16(b[i]))), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)))));
                dm[i] = _mm256_castps_si256(_mm256_mul_ps(
                    _mm256_set1_ps(h2f(rd16(b[i] + 2))), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8)))));
            }
            transpose8_words(ds);
            transpose8_words(dm);
            for (int l = 0; l < 8; l++) {
                _mm256_storeu_si256((__m256i *)(dsc + (u * 8 + l) * 16 + 8 * h), ds[l]);
                _mm256_storeu_si256((__m256i *)(dmn + (u * 8 + l) * 16 + 8 * h), dm[l]);
            }
            for (int t = 0; t < 4; t++) {
                __m256i lo[8], hi[8];
                for (int i = 0; i < 8; i++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(b[i] + 16 + 32 * t));
                    lo[i] = _mm256_and_si256(q, m4);
                    hi[i] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                }
                transpose8_words(lo); /* lo[l]: word l (sub-block l's 4 codes) of the 8 columns */
                transpose8_words(hi);
                for (int l = 0; l < 8; l++) {
                    _mm256_storeu_si256((__m256i *)(o + l * AMX_SUB_BYTES + t * 64 + 32 * h), lo[l]);
                    _mm256_storeu_si256((__m256i *)(o + l * AMX_SUB_BYTES + (t + 4) * 64 + 32 * h), hi[l]);
                }
            }
        }
    }
}

/* Rows r0 .. r0 + 15 (those of the pass) of columns c .. c + 15 from their 8 lanes'
 * accumulators accs[lane][row][column], added in hsum8's order, 16 columns at once. */
AMXF static void amx_store_sums(const job_t *jb, const part_t *p, int64_t c, int64_t r0,
                                float accs[8][16][16]) {
    const int64_t R = jb->m - r0 < 16 ? jb->m - r0 : 16;
    for (int64_t r = 0; r < R; r++) {
        const __m512 s0 = _mm512_add_ps(_mm512_load_ps(accs[0][r]), _mm512_load_ps(accs[4][r]));
        const __m512 s2 = _mm512_add_ps(_mm512_load_ps(accs[2][r]), _mm512_load_ps(accs[6][r]));
        const __m512 s1 = _mm512_add_ps(_mm512_load_ps(accs[1][r]), _mm512_load_ps(accs[5][r]));
        const __m512 s3 = _mm512_add_ps(_mm512_load_ps(accs[3][r]), _mm512_load_ps(accs[7][r]));
        _mm512_storeu_ps(jb->y + (r0 + r) * jb->ldy + p->col0 + c,
                         _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3)));
    }
}

/* Q6_K's tiles: a sub-block is 16 values with its own int8 scale, so each tile
 * multiply-add covers 16 codes (4 rows of 16 columns' 4); lane l of kq_tile's sums
 * holds sub-blocks l and l + 8 (registers t < 4 and t >= 4, word l), scaled as integers
 * there, less 32 x the row's code sums of sub-blocks 2l, 2l + 1 times their scales: the
 * same integers here, two tiles' sums at a time. Codes [nk][16 sub-blocks][4][16][4],
 * then per (block, l) the 16 columns' scales l and l + 8 (int32), their scales 2l, 2l + 1
 * as an int16 pair, and per block d. */
#define AMX_Q6_SUB_BYTES 256
AMXF static void amx_q6k_columns(const part_t *p, int64_t c, int64_t nk, uint8_t *codes,
                                 const amx_scales_t *scales) {
    int32_t *sc_l = scales->sc_l, *sc_h = scales->sc_h, *sc_pair = scales->sc_pair;
    float *dv = scales->d;
    const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(0x3);
    for (int64_t u = 0; u < nk; u++) {
        for (int h = 0; h < 2; h++) { /* columns c + 8h .. c + 8h + 7 */
            const uint8_t *b[8];
            __m256i sl[8], sh[8], sp[8];
            for (int i = 0; i < 8; i++) {
                b[i] = p->w + (c + 8 * h + i) * p->row_bytes + u * p->unit_bytes;
                const __m128i sc = _mm_loadu_si128((const __m128i *)(b[i] + 192));
                sl[i] = _mm256_cvtepi8_epi32(sc);                        /* lane l: scale l */
                sh[i] = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc)); /* scale l + 8 */
                sp[i] = _mm256_cvtepi8_epi16(sc); /* word l: scales 2l, 2l + 1 as int16 */
                dv[u * 16 + 8 * h + i] = h2f(rd16(b[i] + 208));
            }
            transpose8_words(sl);
            transpose8_words(sh);
            transpose8_words(sp);
            for (int l = 0; l < 8; l++) {
                _mm256_storeu_si256((__m256i *)(sc_l + (u * 8 + l) * 16 + 8 * h), sl[l]);
                _mm256_storeu_si256((__m256i *)(sc_h + (u * 8 + l) * 16 + 8 * h), sh[l]);
                _mm256_storeu_si256((__m256i *)(sc_pair + (u * 8 + l) * 16 + 8 * h), sp[l]);
            }
            for (int t = 0; t < 8; t++) { /* register t: sub-blocks l (t < 4) or l + 8 */
                __m256i r[8];
                for (int i = 0; i < 8; i++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(b[i] + 32 * (t & 3)));
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(b[i] + 128 + 32 * (t >> 2)));
                    const __m256i lo4 = t < 4 ? _mm256_and_si256(q, m4) : _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    const __m256i hi2 = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * (t & 3))), m3);
                    r[i] = _mm256_or_si256(lo4, _mm256_slli_epi16(hi2, 4));
                }
                transpose8_words(r); /* r[l]: word l of register t of the 8 columns */
                uint8_t *o = codes + (u * 16 + 8 * (t >> 2)) * AMX_Q6_SUB_BYTES + (t & 3) * 64 + 32 * h;
                for (int l = 0; l < 8; l++) _mm256_storeu_si256((__m256i *)(o + l * AMX_Q6_SUB_BYTES), r[l]);
            }
        }
    }
}

/* Rows 16 at a time over columns c .. c + 15 as amx_q4k_columns / amx_q6k_columns laid
 * them out (scales from f): per lane l, the blocks in order into 16 rows' accumulators,
 * a tile multiply-add per sub-block (Q6_K: two, sub-blocks l and l + 8), then the lane's
 * step for each row (Q4_K: the float step; Q6_K: the integer scale step, then the float
 * one), as kq_tile's lanes do. */
AMXF __attribute__((always_inline)) static inline void amx_tiles(const job_t *jb, const part_t *p, int64_t c,
                                                                 const uint8_t *codes,
                                                                 const amx_scales_t *sc, const int q6) {
    const int64_t nk = jb->nk, m = jb->m;
    int32_t cb0[16][16] __attribute__((aligned(64))), cb1[16][16] __attribute__((aligned(64)));
    float accs[8][16][16] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < m; r0 += 16) {
        const int8_t *xa = jb->xa + r0 * nk * 256;
        const xk_t *xr = jb->xk + r0 * nk; /* padded to 16 rows, as xa */
        for (int l = 0; l < 8; l++) {
            __m512 acc[16];
            for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t u = 0; u < nk; u++) {
                const int64_t at = (u * 8 + l) * 16;
                if (q6) {
                    _tile_loadd(2, xa + u * 256 + 16 * l, nk * 256);
                    _tile_loadd(3, xa + u * 256 + 16 * (l + 8), nk * 256);
                    _tile_loadd(4, codes + (u * 16 + l) * AMX_Q6_SUB_BYTES, 64);
                    _tile_loadd(5, codes + (u * 16 + l + 8) * AMX_Q6_SUB_BYTES, 64);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_dpbsud(0, 2, 4);
                    _tile_dpbsud(1, 3, 5);
                    _tile_stored(0, cb0, 64);
                    _tile_stored(1, cb1, 64);
                    const __m512i sl = _mm512_loadu_si512(sc->sc_l + at), sh = _mm512_loadu_si512(sc->sc_h + at);
                    const __m512i sp = _mm512_loadu_si512(sc->sc_pair + at);
                    const __m512 d = _mm512_loadu_ps(sc->d + u * 16);
                    for (int r = 0; r < 16; r++) {
                        const xk_t *xb = xr + r * nk + u;
                        int32_t pair;
                        memcpy(&pair, xb->bsums + 2 * l, 4);
                        const __m512i bs = _mm512_madd_epi16(_mm512_set1_epi32(pair), sp);
                        __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(cb0[r]), sl),
                                                       _mm512_mullo_epi32(_mm512_load_si512(cb1[r]), sh));
                        sum = _mm512_sub_epi32(sum, _mm512_slli_epi32(bs, 5));
                        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), d), _mm512_set1_ps(xb->d),
                                                 acc[r]);
                    }
                } else {
                    _tile_loadd(1, xa + u * 256 + 32 * l, nk * 256);
                    _tile_loadd(2, codes + (u * 8 + l) * AMX_SUB_BYTES, 64);
                    _tile_zero(0);
                    _tile_dpbsud(0, 1, 2);
                    _tile_stored(0, cb0, 64);
                    const __m512 ds = _mm512_loadu_ps(sc->dsc + at), dm = _mm512_loadu_ps(sc->dmn + at);
                    for (int r = 0; r < 16; r++) {
                        const xk_t *xb = xr + r * nk + u;
                        const __m512 v = _mm512_fnmadd_ps(_mm512_set1_ps(xb->bs32f[l]), dm,
                                                          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb0[r])), ds));
                        acc[r] = _mm512_fmadd_ps(v, _mm512_set1_ps(xb->d), acc[r]);
                    }
                }
            }
            for (int r = 0; r < 16; r++) _mm512_store_ps(accs[l][r], acc[r]);
        }
        amx_store_sums(jb, p, c, r0, accs);
    }
}

AMXF static void amx_run(const job_t *jb, const part_t *p, int64_t c0, int64_t c1, const tile_set *ts) {
    const int64_t nk = jb->nk, g1 = c0 + (c1 - c0) / 16 * 16;
    const int q6 = p->type == T_Q6_K;
    /* codes 4 KiB a block either way; Q4_K's scales 2 x 8 x 16 floats, Q6_K's 3 x 8 x 16
     * int32 and 16 floats */
    const int64_t need = nk * (8 * AMX_SUB_BYTES + (q6 ? 3 * 8 * 16 + 16 : 2 * 8 * 16) * 4); /* amx_scales_t */
    uint8_t *codes = g1 > c0 ? scratch_get(&t_amx_scratch, need) : NULL;
    if (codes) {
        amx_cfg_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        if (q6) { /* sums 16 rows x 16 columns; activations 16 rows x 16 codes; codes 4 x 16 x 4 */
            cfg.rows[0] = cfg.rows[1] = 16, cfg.colsb[0] = cfg.colsb[1] = 64;
            cfg.rows[2] = cfg.rows[3] = 16, cfg.colsb[2] = cfg.colsb[3] = 16;
            cfg.rows[4] = cfg.rows[5] = 4, cfg.colsb[4] = cfg.colsb[5] = 64;
        } else { /* sums 16 rows x 16 columns; activations 16 rows x 32 codes; codes 8 x 16 x 4 */
            cfg.rows[0] = 16, cfg.colsb[0] = 64;
            cfg.rows[1] = 16, cfg.colsb[1] = 32;
            cfg.rows[2] = 8, cfg.colsb[2] = 64;
        }
        _tile_loadconfig(&cfg);
        float *f = (float *)(codes + nk * 8 * AMX_SUB_BYTES);
        int32_t *in = (int32_t *)f;
        const amx_scales_t sc = {f, f + nk * 128, in, in + nk * 128, in + nk * 256, f + nk * 384};
        for (int64_t c = c0; c < g1; c += 16) {
            if (q6) {
                amx_q6k_columns(p, c, nk, codes, &sc);
                amx_tiles(jb, p, c, codes, &sc, 1);
            } else {
                amx_q4k_columns(p, c, nk, codes, &sc);
                amx_tiles(jb, p, c, codes, &sc, 0);
            }
        }
        _tile_release();
        c0 = g1;
    }
    if (c0 < c1) rows_outer_run(jb, p, c0, c1, ts, kind_of(p->type), ts->cols);
}
#endif

static void cols_run(const job_t *jb, const part_t *p, int64_t c0, int64_t c1, const tile_set *ts) {
    const int kind = kind_of(p->type);
    /* A pass of up to ts->rows rows (a decode step or a verify pass) is one tile, a
     * column at a time: each weight block is decoded once for all its rows. K-quant
     * passes of RO_MIN_ROWS rows or more (a prefill) go through rows_outer_run. Other
     * passes of more rows go a block of rows at a time, in tiles of up to MANY_ROWS_TILE rows (of
     * balanced heights: 9 rows are 3 + 3 + 3, not 4 + 4 + 1) over pairs of columns, so
     * that the block's quantized activations stay in L2 while the chunk's columns pass
     * over them; column outer, row tiles inner, so a column's blocks stay in L1 across
     * the tiles. (One-column tiles of 8 rows measured slower from 16 rows on, in L2 on
     * a Zen 4 EPYC: 10.0 against 9.3 cycles per row and Q4_K block.) */
    const int one_col = jb->m <= ts->rows;
    const int cols = one_col ? 1 : ts->cols;
    if (one_col && is_kquant(p->type) && g_span_blocks && jb->m * jb->nk * XK_TILE_BYTES > SPAN_ACT_BYTES) {
        spans_run(jb, p, c0, c1, ts);
        return;
    }
    const int64_t tile_rows = one_col ? ts->rows : MANY_ROWS_TILE;
    if (!one_col && g_rows_outer && jb->m >= RO_MIN_ROWS && is_kquant(p->type)) {
#ifdef SPEC_AMX
        if (jb->xa && amx_for(p->type, jb->path, jb->m)) {
            amx_run(jb, p, c0, c1, ts);
            return;
        }
#endif
        rows_outer_run(jb, p, c0, c1, ts, kind, cols);
        return;
    }
    if (one_col && is_kquant(p->type) && wide_for(ts, jb->m)) {
        /* a verify pass: its rows over two columns at a time (kq_wide) */
        const span_fn fw = kq_wide_fn[p->type == T_Q6_K][jb->m - 1];
        for (int64_t c = c0; c < c1; c += 2) {
            if (c + 1 < c1)
                fw(jb, p, 0, c, 0, jb->nk, NULL);
            else
                ts->fn[kind][jb->m - 1][0](jb, p, 0, c);
        }
        return;
    }
    const int64_t rb = one_col ? jb->m : jb->row_block;
    for (int64_t b0 = 0; b0 < jb->m; b0 += rb) {
        const int64_t b1 = b0 + rb < jb->m ? b0 + rb : jb->m, rows = b1 - b0;
        const int64_t ntiles = (rows + tile_rows - 1) / tile_rows;
        for (int64_t c = c0; c < c1;) {
            const int C = c1 - c >= cols ? cols : 1;
            for (int64_t t = 0; t < ntiles; t++) { /* tiles of balanced heights */
                const int64_t r0 = b0 + rows * t / ntiles, r1 = b0 + rows * (t + 1) / ntiles;
                ts->fn[kind][r1 - r0 - 1][C - 1](jb, p, r0, c);
            }
            c += C;
        }
    }
}
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
#ifdef SPEC_AMX
        unsigned a, b, c, d;
        /* AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25), and the kernel's leave to
         * use the tile data (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA) */
        if ((f & FEAT_AVX512VNNI) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) &&
            (d >> 25 & 1) && syscall(SYS_arch_prctl, 0x1023, 18) == 0)
            f |= FEAT_AMX;
#endif
        if (g_wide_tiles < 0) g_wide_tiles = __builtin_cpu_is("intel") ? 1 : 0;
        if (g_prefetch_l2_bytes < 0) g_prefetch_l2_bytes = __builtin_cpu_is("intel") ? PREFETCH_L2_INTEL : 0;
#else
        if (g_wide_tiles < 0) g_wide_tiles = 0;
        if (g_prefetch_l2_bytes < 0) g_prefetch_l2_bytes = 0;
#endif
        /* on where the CPU has them: a 1,170-token prefill of the 1.5B 0.66-0.72x of the
         * time on a Xeon */
        if (g_amx_tiles < 0) g_amx_tiles = (f & FEAT_AMX) ? 1 : 0;
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
    /* Auto takes VNNI where it exists (its 4-byte dot products halve the multiplies of a
     * verify pass: docs/native.md), else AVX2: the AVX-512 path without VNNI measured no
     * faster than AVX2 on a Zen 4 EPYC. */
    if (path_ok(PATH_AVX512VNNI)) return PATH_AVX512VNNI;
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
        cols_portable(jb, p, lo - a, hi - a);
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
            /* give the core away now and then: on a busy machine another process may need
             * it (sched_yield returns at once when nothing else is waiting) */
            if (++spins % 256 == 0) sched_yield();
            if (spins % 256 == 0 && now_us() - t0 > pool.spin_us) {
                pthread_mutex_lock(&pool.mu);
                pool.sleepers++;
                while (atomic_load(&pool.gen) == seen && !pool.quit)
                    pthread_cond_wait(&pool.cv, &pool.mu);
                pool.sleepers--;
                pthread_mutex_unlock(&pool.mu);
                break;
            }
        }
        if (pool.quit) {
            scratch_free();
            return NULL;
        }
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
    /* A worker that the OS has put aside would leave this loop spinning for its whole
     * time slice: yield now and then, so that it gets the core back. */
    for (int spins = 1; atomic_load_explicit(&pool.finished, memory_order_acquire) < pool.nworkers;
         spins++) {
        cpu_relax();
        if (spins % 64 == 0) sched_yield();
    }
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

/* Benchmark knobs (results never depend on them): 0 the prefetch distance in bytes past
 * each weight unit (0: none), 1 the fewest rows a tile prefetches for, 2 chunks per
 * thread, 3 the most columns in a chunk, 4 the pairs of query rows an attention task
 * takes together (0: one row at a time; at most ATTN_MAX_PAIRS), 5-7 spans (spans_run):
 * blocks of a span (0: no spans), columns of a group, pieces prefetched ahead, 8
 * rows_outer_run's L1 budget, 9-11 kq_wide's tiles (on, rows a tile, fewest rows), 12
 * AMX tiles for prefill (0 off, 1 Q4_K, 2 Q6_K too), 13 attention in 512-bit registers
 * on the AVX-512 paths (1) or 256-bit ones (0), 14 the keys from which attention
 * spreads a pass's rows over fewer tasks (attention_long_keys), 15-16 the L2 prefetch
 * (bytes past the L1 prefetch, 0: none; the most rows of a pass that issues it). A value of -1 only
 * reads. Returns the old value; -1 for an unknown knob, -2 for a value out of the knob's
 * range, -3 for AMX tiles asked of a CPU (or OS) without them. */
int spec_tune(int knob, int value) {
    static int *const knobs[] = {&g_prefetch_bytes, &g_prefetch_rows, &g_chunks_per_thread,
                                 &g_max_chunk_cols, &g_attn_pairs,   &g_span_blocks,
                                 &g_span_cols,      &g_span_ahead, &g_rows_outer,
                                 &g_wide_tiles,     &g_wide_rows,  &g_wide_min_rows,
                                 &g_amx_tiles,      &g_attn_512,   &g_attn_long_keys,
                                 &g_prefetch_l2_bytes, &g_prefetch_l2_rows};
    static const int least[] = {0, 0, 1, 4, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0};
    features(); /* resolves g_wide_tiles', g_amx_tiles' and g_prefetch_l2_bytes' defaults */
    if (knob < 0 || knob >= (int)(sizeof knobs / sizeof knobs[0])) return -1;
    const int old = *knobs[knob];
    if (value == -1) return old;
    if (value < least[knob] || (knobs[knob] == &g_wide_rows && value > WIDE_ROWS) ||
        (knobs[knob] == &g_amx_tiles && value > 2) || (knobs[knob] == &g_attn_512 && value > 1) ||
        (knobs[knob] == &g_attn_pairs && value > ATTN_MAX_PAIRS))
        return -2;
    if (knobs[knob] == &g_amx_tiles && value > 0 && !(features() & FEAT_AMX)) return -3;
    *knobs[knob] = value;
    return old;
}

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

/* Bytes of one packed row of K values (0 when the type or K is unsupported). */
int64_t spec_packed_row_bytes(int type, int64_t K) {
    if (spec_row_bytes(type, K) == 0) return 0;
    return row_units(type, K) * unit_bytes(type);
}

/* fn(ctx, r0, r1) over the rows [0, m) in chunks of `per` rows, shared out over the
 * threads: for work done row by row (each row on its own, so the split changes no
 * result). */
typedef void (*rows_fn)(const void *ctx, int64_t r0, int64_t r1);
typedef struct {
    rows_fn fn;
    const void *ctx;
    int64_t m, per;
} rows_job_t;

static void rows_chunk(const void *ctx, int64_t chunk) {
    const rows_job_t *rj = ctx;
    const int64_t r0 = chunk * rj->per, r1 = r0 + rj->per < rj->m ? r0 + rj->per : rj->m;
    rj->fn(rj->ctx, r0, r1);
}

static void run_rows(int64_t m, int64_t per, rows_fn fn, const void *ctx, int nthreads) {
    rows_job_t rj = {fn, ctx, m, per};
    job_t jb;
    memset(&jb, 0, sizeof jb);
    jb.task = rows_chunk;
    jb.ctx = &rj;
    jb.nchunks = (m + per - 1) / per;
    pool_run(&jb, nthreads);
}

typedef struct {
    int type;
    const uint8_t *src;
    int64_t K;
    uint8_t *dst;
} repack_t;

static void repack_part(const void *ctx, int64_t r0, int64_t r1) {
    const repack_t *rp = ctx;
    repack_rows(rp->type, rp->src, rp->K, r0, r1, rp->dst);
}

/* The n stored rows of src into dst (spec_packed_row_bytes(type, K) bytes a row), in the
 * layout spec_linear reads. Returns 0, or -1 for an unsupported type or K. */
int spec_repack(int type, const void *src, int64_t n, int64_t K, void *dst, int nthreads) {
    if (spec_packed_row_bytes(type, K) == 0) return -1;
    repack_t rp = {type, (const uint8_t *)src, K, (uint8_t *)dst};
    run_rows(n, 64, repack_part, &rp, nthreads);
    return 0;
}

/* The activation rows of a pass, quantized for the K-quant parts (xk) and the legacy ones
 * (xg) where wanted: each row by itself (the same bits whoever quantizes it), so a pass
 * of many rows (a prefill) shares the rows out over the threads. */

typedef struct {
    const float *x;
    int64_t K;
    xk_t *xk;
    xg_t *xg;
    int8_t *xa;
    int path;
} quant_t;

#define ROW_CHUNK 16 /* rows a thread takes at a time of the row-by-row work of a pass */
static void quantize_part(const void *ctx, int64_t r0, int64_t r1) {
    const quant_t *q = ctx;
    const int64_t nk = q->K / 256, ng = (q->K / 32 + 7) / 8;
    for (int64_t r = r0; r < r1; r++) {
        int8_t *xa = q->xa ? q->xa + r * nk * 256 : NULL;
        if (q->xk) quantize_row_k(q->x + r * q->K, q->K, q->xk + r * nk, xa, q->path);
        if (q->xg) quantize_row_g(q->x + r * q->K, q->K, q->xg + r * ng, q->path);
    }
}

/* y[r * ldy + c] for r < m and the parts' columns (concatenated in order); the parts'
 * weights are packed (spec_repack). Returns 0, or a negative code: -1 unsupported type,
 * -2 K not a block multiple, -3 too many parts, -4 out of memory. */
int spec_linear(int nparts, const int *types, const void *const *weights, const int64_t *ns,
                int64_t K, const float *x, int64_t m, float *y, int64_t ldy, int nthreads) {
    if (nparts < 1 || nparts > MAX_PARTS) return -3;
    job_t jb;
    memset(&jb, 0, sizeof jb);
    int needk = 0, needg = 0;
    int64_t col = 0;
    for (int i = 0; i < nparts; i++) {
        if (!spec_supported(types[i])) return -1;
        int64_t rb = spec_packed_row_bytes(types[i], K);
        if (rb == 0) return -2;
        jb.parts[i] = (part_t){types[i], (const uint8_t *)weights[i], ns[i], col, rb, unit_bytes(types[i])};
        col += ns[i];
        if (is_kquant(types[i]))
            needk = 1;
        else
            needg = 1;
    }
    jb.nparts = nparts;
    jb.K = K;
    jb.m = m;
    jb.ldy = ldy;
    jb.y = y;
    jb.nk = K / 256;
    jb.ng = (K / 32 + 7) / 8;
    jb.path = resolve_path();
    if (jb.path < 0) jb.path = PATH_PORTABLE;
    xk_t *xk = NULL;
    xg_t *xg = NULL;
    int8_t *xa = NULL;
    /* AMX tiles take 16 rows at a time: their activations padded with zero rows */
    int amx = 0;
    for (int i = 0; i < nparts; i++) amx |= amx_for(types[i], jb.path, m);
    const int64_t mk = amx ? (m + 15) / 16 * 16 : m;
    if (needk) xk = aligned_alloc(64, sizeof(xk_t) * (size_t)(mk * jb.nk));
    if (needg) xg = malloc(sizeof(xg_t) * (size_t)(m * jb.ng));
    if (amx) xa = aligned_alloc(64, (size_t)(mk * jb.nk * 256));
    if ((needk && !xk) || (needg && !xg) || (amx && !xa)) {
        free(xk);
        free(xg);
        free(xa);
        return -4;
    }
    if (amx) {
        memset(xk + m * jb.nk, 0, sizeof(xk_t) * (size_t)((mk - m) * jb.nk));
        memset(xa + m * jb.nk * 256, 0, (size_t)((mk - m) * jb.nk * 256));
    }
    const quant_t q = {x, K, xk, xg, xa, jb.path};
    run_rows(m, ROW_CHUNK, quantize_part, &q, nthreads);
    jb.xk = xk;
    jb.xg = xg;
    jb.xa = xa;
    /* Columns per chunk: enough work per chunk to amortize the hand-out, enough chunks
     * to balance the threads; even, so that two-column tiles stay whole. Results do not
     * depend on it. */
    int64_t cc = 16;
    if (nthreads > 1) {
        int64_t target = col / ((int64_t)nthreads * g_chunks_per_thread);
        cc = target < 4 ? 4 : (target > g_max_chunk_cols ? g_max_chunk_cols : target);
        cc += cc & 1;
    } else {
        cc = col;
    }
    /* Rows per block: their quantized activations within ~128 KiB (L2 with the chunk's
     * weights), and a chunk's weights within ~64 KiB when the rows are many. */
    int64_t xrow = needk ? (int64_t)sizeof(xk_t) * jb.nk : 0;
    if (needg && (int64_t)sizeof(xg_t) * jb.ng > xrow) xrow = (int64_t)sizeof(xg_t) * jb.ng;
    int64_t rbk = ((int64_t)128 * 1024 / xrow) / MAX_ROWS_TILE * MAX_ROWS_TILE;
    jb.row_block = rbk < MAX_ROWS_TILE ? MAX_ROWS_TILE : rbk;
    if (m > jb.row_block) {
        int64_t maxrb = 0;
        for (int i = 0; i < nparts; i++)
            if (jb.parts[i].row_bytes > maxrb) maxrb = jb.parts[i].row_bytes;
        int64_t capc = (int64_t)64 * 1024 / maxrb;
        if (capc < 4) capc = 4;
        if (cc > capc) cc = capc + (capc & 1);
    }
    if (amx) cc = (cc + 15) / 16 * 16; /* whole AMX column groups */
    jb.chunk_cols = cc;
    jb.nchunks = (col + cc - 1) / cc;
    pool_run(&jb, nthreads);
    free(xk);
    free(xg);
    free(xa);
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
    const int path = resolve_path();
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < K / per; b++)
            quantize_block(x + r * K + b * per, per, &scales[r * (K / per) + b],
                           codes + r * K + b * per, path);
    return 0;
}


/* ------------------------------------------------- attention and RMS norm (float32) */
/* Both reduce in a fixed order that depends on nothing but the row itself: the norm in 8
 * lanes (lane l takes elements l, l+8, ...), added as hsum8; an attention score in 16
 * lanes (lane l takes elements l, l+16, ...; a last 8 elements go to lanes 0-7), lane l
 * and lane l+8 added, then hsum8; keys visited in ascending order. A query row's result
 * is therefore the same whatever else shares the pass, however long the key span, and on
 * every path (the vector code does the same float operations). */
static float dot8_portable(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    for (int64_t i = 0; i < n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    return hsum8(acc);
}

/* an attention score's dot product (n a multiple of 8) */
static float dot16_portable(const float *a, const float *b, int64_t n) {
    float acc[16] = {0}, t[8];
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    if (i < n)
        for (int l = 0; l < 8; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    for (int l = 0; l < 8; l++) t[l] = acc[l] + acc[l + 8];
    return hsum8(t);
}

/* y[i] += p * v[i], one rounding */
static void axpy_portable(float *y, float p, const float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = fmaf(p, v[i], y[i]);
}

/* exp(x) for the softmax's x = score - max <= 0: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2
 * in two parts, Cody and Waite's reduction), exp(r) by a degree-7 polynomial (Cephes'
 * expf coefficients: about 1 ulp), times 2^n put in the exponent bits. Below -87 (where 2^n
 * would leave the normal range) it gives 0; a NaN goes on. The vector code (exp8_avx2)
 * does the same float operations, so both give the same bits. */
#define EXP_LOW (-87.0f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_neg(float x) {
    if (x != x) return x;
    if (x < EXP_LOW) return 0.0f;
    const float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_HI, x);
    r = fmaf(n, -EXP_LN2_LO, r);
    float p = EXP_POLY[0];
    for (int k = 1; k < 6; k++) p = fmaf(p, r, EXP_POLY[k]);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* s[j] = exp_neg(s[j] - mx) for j < n; returns their sum, added in 8 lanes (value j in
 * lane j % 8, in ascending j) and the lanes summed by hsum8. */
static float softmax_exp_portable(float *s, int64_t n, float mx) {
    float lanes[8] = {0};
    for (int64_t j = 0; j < n; j++) {
        s[j] = exp_neg(s[j] - mx);
        lanes[j & 7] = lanes[j & 7] + s[j];
    }
    return hsum8(lanes);
}

#ifdef SPEC_X86
AVX2 static float dot8_avx2(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8_avx(acc);
}

/* dot16_portable's numbers: lanes 0-7 and 8-15 in two registers */
AVX2 static float dot16_avx2(const float *a, const float *b, int64_t n) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    if (i < n) lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
    return hsum8_avx(_mm256_add_ps(lo, hi));
}

/* exp_neg of 8 values */
AVX2 static inline __m256 exp8_avx2(__m256 x) {
    const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LOW), _CMP_LT_OQ);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int k = 1; k < 6; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[k]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(small, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* softmax_exp_portable's numbers */
AVX2 static float softmax_exp_avx2(float *s, int64_t n, float mx) {
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (; j < n; j++) {
        s[j] = exp_neg(s[j] - mx);
        lanes[j & 7] = lanes[j & 7] + s[j];
    }
    return hsum8(lanes);
}

/* s[j] = exp(s[j] - max s) for j < n, in place; returns their sum */
AVX2 static float softmax_avx2(float *s, int64_t n) {
    /* the largest score, 8 lanes x 4 at a time: max is exact and max_ps(x, m) keeps m
     * where x is NaN, as the portable s > mx ? s : mx does; +0 / -0 ties may pick either
     * sign, which no exp(s - mx) below can tell apart */
    __m256 m[4];
    for (int e = 0; e < 4; e++) m[e] = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        for (int e = 0; e < 4; e++) m[e] = _mm256_max_ps(_mm256_loadu_ps(s + j + 8 * e), m[e]);
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    float mx = -INFINITY;
    for (int e = 0; e < 8; e++) mx = lanes[e] > mx ? lanes[e] : mx;
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return softmax_exp_avx2(s, n, mx);
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
    int64_t pairs;     /* pairs of rows an attend_rows task takes */
    atomic_int failed; /* a score buffer could not be allocated */
    const struct attn_code *code; /* the vector code (run_attention's choice) */
    /* a float16 cache (kv_dtype float16): k16 / v16 in place of k / v, widened to float32
     * a block of keys at a time before the same float32 code runs on them (exact: every
     * float16 value is a float32 one), so a row's result is the float32 code's over the
     * cache's values, whatever the cache's type */
    const uint16_t *k16, *v16;
    float softcap; /* > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2) */
} attn_t;

/* Gemma 2's attention soft-cap, on one row's n scores before its softmax. */
static void softcap_scores(float *s, int64_t n, float cap) {
    if (cap <= 0.0f) return;
    for (int64_t j = 0; j < n; j++) s[j] = cap * tanhf(s[j] / cap);
}

/* keys or values j0 .. j1 - 1 (rows of hd) of a float16 cache into dst as float32 (exact,
 * so the same values on every path); F16C's instructions where path has them */
static void kv_widen(const uint16_t *src, int64_t j0, int64_t j1, int64_t hd, float *dst, int path) {
    const uint16_t *s = src + j0 * hd;
    const int64_t n = (j1 - j0) * hd;
#ifdef SPEC_X86
    if (path >= PATH_AVX512) {
        kv_widen_f16c512(s, n, dst);
        return;
    }
    if (path >= PATH_AVX2) {
        kv_widen_f16c(s, n, dst);
        return;
    }
#endif
    (void)path;
    for (int64_t i = 0; i < n; i++) dst[i] = h2f(s[i]);
}

/* n float32 values (n a multiple of 8) into a float16 cache row, rounded to nearest even:
 * F16C's vcvtps2ph where path has it, f2h otherwise (the same bits) */
static void kv_narrow(const float *src, int64_t n, uint16_t *dst, int path) {
#ifdef SPEC_X86
    if (path >= PATH_AVX2) {
        kv_narrow_f16c(src, n, dst);
        return;
    }
#endif
    (void)path;
    for (int64_t i = 0; i < n; i++) dst[i] = f2h(src[i]);
}

/* One (query head, query row) pair, the portable code: chunk = h * T + t. */
static void attend_one(const void *ctx, int64_t chunk) {
    const attn_t *a = ctx;
    const int64_t h = chunk / a->T, t = chunk % a->T;
    const int64_t g = h / (a->nh / a->nkv);
    const float *q = a->q + t * a->q_t + h * a->q_h;
    const float *keys = a->k ? a->k + g * a->rows * a->hd : NULL;
    const float *vals = a->v ? a->v + g * a->rows * a->hd : NULL;
    float *o = a->out + t * a->o_t + h * a->o_h;
    const int64_t lo = a->lo[t], hi = a->hi[t], n = hi - lo;
    for (int64_t i = 0; i < a->hd; i++) o[i] = 0.0f;
    if (n <= 0) return;
    float *s = scratch_get(&t_attn_scratch, (int64_t)sizeof(float) * n);
    float *row = a->k16 ? scratch_get(&t_kv_scratch, (int64_t)sizeof(float) * a->hd) : NULL;
    if (!s || (a->k16 && !row)) {
        atomic_store(&((attn_t *)a)->failed, 1);
        return;
    }
    const int64_t base = g * a->rows; /* the group's first cache row */
    float (*dot)(const float *, const float *, int64_t) = dot16_portable;
    void (*axpy)(float *, float, const float *, int64_t) = axpy_portable;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float *kr = keys + (lo + j) * a->hd;
        if (a->k16) kv_widen(a->k16, base + lo + j, base + lo + j + 1, a->hd, row, PATH_PORTABLE), kr = row;
        s[j] = dot(q, kr, a->hd) * a->scale;
        if (a->softcap > 0.0f) s[j] = a->softcap * tanhf(s[j] / a->softcap);
        mx = s[j] > mx ? s[j] : mx;
    }
    const float sum = softmax_exp_portable(s, n, mx);
    for (int64_t j = 0; j < n; j++) {
        const float *vr = vals + (lo + j) * a->hd;
        if (a->v16) kv_widen(a->v16, base + lo + j, base + lo + j + 1, a->hd, row, PATH_PORTABLE), vr = row;
        axpy(o, s[j], vr, a->hd);
    }
    for (int64_t i = 0; i < a->hd; i++) o[i] = o[i] / sum;
}

#ifdef SPEC_X86
#define GROUP_HEADS 8 /* query heads of a group taken together */
#define KEY_BLOCK 32  /* keys (and values) taken together, within L1 */

/* hsum8_avx of a0, a1, a2, a3 as one vector (each the same tree of adds: bitwise) */
AVX2 static inline __m128 hsum8x4_avx(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    /* [s0 | s2], [s1 | s3] with s = low half + high half */
    const __m256 p = _mm256_add_ps(_mm256_permute2f128_ps(a0, a2, 0x20), _mm256_permute2f128_ps(a0, a2, 0x31));
    const __m256 q = _mm256_add_ps(_mm256_permute2f128_ps(a1, a3, 0x20), _mm256_permute2f128_ps(a1, a3, 0x31));
    /* [t0 | t2] interleaved with [t1 | t3]: t = (s0 + s2, s1 + s3) */
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(p, q, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(p, q, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m128 lo = _mm256_castps256_ps128(t), hi = _mm256_extractf128_ps(t, 1);
    return _mm_add_ps(_mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)), _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores over keys j0 .. j1 - 1 (absolute; the score of key j at s[j - sb]) for one
 * query, or for two queries that share the key loads: dot16_portable's numbers, 4 keys
 * (one query) or 2 keys (two) at a time, each in two registers (lanes 0-7, 8-15). */
AVX2 static void scores_one(const float *q, const float *keys, int64_t j0, int64_t j1, int64_t hd,
                            float scale, float *s, int64_t sb) {
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        const float *k0 = keys + j * hd;
        __m256 a[4], b[4];
        for (int e = 0; e < 4; e++) a[e] = b[e] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= hd; i += 16) {
            const __m256 qa = _mm256_loadu_ps(q + i), qb = _mm256_loadu_ps(q + i + 8);
            for (int e = 0; e < 4; e++) {
                a[e] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k0 + e * hd + i), a[e]);
                b[e] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(k0 + e * hd + i + 8), b[e]);
            }
        }
        if (i < hd) {
            const __m256 qa = _mm256_loadu_ps(q + i);
            for (int e = 0; e < 4; e++) a[e] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(k0 + e * hd + i), a[e]);
        }
        for (int e = 0; e < 4; e++) a[e] = _mm256_add_ps(a[e], b[e]);
        _mm_storeu_ps(s + j - sb, _mm_mul_ps(hsum8x4_avx(a[0], a[1], a[2], a[3]), _mm_set1_ps(scale)));
    }
    for (; j < j1; j++) s[j - sb] = dot16_avx2(q, keys + j * hd, hd) * scale;
}

/* s0[j - b0], s1[j - b1] for keys j0 .. j1 - 1 of queries q0, q1 */
AVX2 static void scores_two(const float *q0, const float *q1, const float *keys, int64_t j0, int64_t j1,
                            int64_t hd, float scale, float *s0, int64_t b0, float *s1, int64_t b1) {
    int64_t j = j0;
    for (; j + 2 <= j1; j += 2) {
        const float *k0 = keys + j * hd;
        __m256 a[2][2], b[2][2]; /* [query][key]: lanes 0-7 in a, 8-15 in b */
        for (int r = 0; r < 2; r++)
            for (int e = 0; e < 2; e++) a[r][e] = b[r][e] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= hd; i += 16) {
            const __m256 qa0 = _mm256_loadu_ps(q0 + i), qb0 = _mm256_loadu_ps(q0 + i + 8);
            const __m256 qa1 = _mm256_loadu_ps(q1 + i), qb1 = _mm256_loadu_ps(q1 + i + 8);
            for (int e = 0; e < 2; e++) {
                const __m256 ka = _mm256_loadu_ps(k0 + e * hd + i), kb = _mm256_loadu_ps(k0 + e * hd + i + 8);
                a[0][e] = _mm256_fmadd_ps(qa0, ka, a[0][e]);
                b[0][e] = _mm256_fmadd_ps(qb0, kb, b[0][e]);
                a[1][e] = _mm256_fmadd_ps(qa1, ka, a[1][e]);
                b[1][e] = _mm256_fmadd_ps(qb1, kb, b[1][e]);
            }
        }
        if (i < hd) {
            const __m256 qa0 = _mm256_loadu_ps(q0 + i), qa1 = _mm256_loadu_ps(q1 + i);
            for (int e = 0; e < 2; e++) {
                const __m256 ka = _mm256_loadu_ps(k0 + e * hd + i);
                a[0][e] = _mm256_fmadd_ps(qa0, ka, a[0][e]);
                a[1][e] = _mm256_fmadd_ps(qa1, ka, a[1][e]);
            }
        }
        const __m128 sums = hsum8x4_avx(_mm256_add_ps(a[0][0], b[0][0]), _mm256_add_ps(a[0][1], b[0][1]),
                                        _mm256_add_ps(a[1][0], b[1][0]), _mm256_add_ps(a[1][1], b[1][1]));
        const __m128 sc = _mm_mul_ps(sums, _mm_set1_ps(scale));
        _mm_storel_pi((__m64 *)(s0 + j - b0), sc);
        _mm_storeh_pi((__m64 *)(s1 + j - b1), sc);
    }
    for (; j < j1; j++) {
        s0[j - b0] = dot16_avx2(q0, keys + j * hd, hd) * scale;
        s1[j - b1] = dot16_avx2(q1, keys + j * hd, hd) * scale;
    }
}

/* values_one's and values_two's 8 output values at i0 */
AVX2 static inline void values_one8(float *o, const float *s, int64_t sb, const float *vals, int64_t j0, int64_t j1,
                                    int64_t hd, int64_t i0) {
    __m256 y = _mm256_loadu_ps(o + i0);
    for (int64_t j = j0; j < j1; j++)
        y = _mm256_fmadd_ps(_mm256_set1_ps(s[j - sb]), _mm256_loadu_ps(vals + j * hd + i0), y);
    _mm256_storeu_ps(o + i0, y);
}
AVX2 static inline void values_two8(float *o0, float *o1, const float *s0, int64_t b0, const float *s1, int64_t b1,
                                    const float *vals, int64_t j0, int64_t j1, int64_t hd, int64_t i0) {
    __m256 y = _mm256_loadu_ps(o0 + i0), z = _mm256_loadu_ps(o1 + i0);
    for (int64_t j = j0; j < j1; j++) {
        const __m256 vv = _mm256_loadu_ps(vals + j * hd + i0);
        y = _mm256_fmadd_ps(_mm256_set1_ps(s0[j - b0]), vv, y);
        z = _mm256_fmadd_ps(_mm256_set1_ps(s1[j - b1]), vv, z);
    }
    _mm256_storeu_ps(o0 + i0, y);
    _mm256_storeu_ps(o1 + i0, z);
}

/* o += s[j - sb] v_j for keys j0 .. j1 - 1, in ascending order */
AVX2 static void values_one(float *o, const float *s, int64_t sb, const float *vals, int64_t j0, int64_t j1,
                            int64_t hd) {
    int64_t i0 = 0;
    for (; i0 + 64 <= hd; i0 += 64) {
        __m256 y[8];
        for (int b = 0; b < 8; b++) y[b] = _mm256_loadu_ps(o + i0 + 8 * b);
        for (int64_t j = j0; j < j1; j++) {
            const __m256 p = _mm256_set1_ps(s[j - sb]);
            const float *v = vals + j * hd + i0;
            for (int b = 0; b < 8; b++) y[b] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * b), y[b]);
        }
        for (int b = 0; b < 8; b++) _mm256_storeu_ps(o + i0 + 8 * b, y[b]);
    }
    for (; i0 < hd; i0 += 8) values_one8(o, s, sb, vals, j0, j1, hd, i0);
}

AVX2 static void values_two(float *o0, float *o1, const float *s0, int64_t b0, const float *s1, int64_t b1,
                            const float *vals, int64_t j0, int64_t j1, int64_t hd) {
    int64_t i0 = 0;
    for (; i0 + 32 <= hd; i0 += 32) {
        __m256 y[4], z[4];
        for (int b = 0; b < 4; b++) {
            y[b] = _mm256_loadu_ps(o0 + i0 + 8 * b);
            z[b] = _mm256_loadu_ps(o1 + i0 + 8 * b);
        }
        for (int64_t j = j0; j < j1; j++) {
            const __m256 p0 = _mm256_set1_ps(s0[j - b0]), p1 = _mm256_set1_ps(s1[j - b1]);
            const float *v = vals + j * hd + i0;
            for (int b = 0; b < 4; b++) {
                const __m256 vv = _mm256_loadu_ps(v + 8 * b);
                y[b] = _mm256_fmadd_ps(p0, vv, y[b]);
                z[b] = _mm256_fmadd_ps(p1, vv, z[b]);
            }
        }
        for (int b = 0; b < 4; b++) {
            _mm256_storeu_ps(o0 + i0 + 8 * b, y[b]);
            _mm256_storeu_ps(o1 + i0 + 8 * b, z[b]);
        }
    }
    for (; i0 < hd; i0 += 8) values_two8(o0, o1, s0, b0, s1, b1, vals, j0, j1, hd, i0);
}

/* values_one and values_two in 512-bit registers, for the AVX-512 paths: every output
 * value is the same chain of fused multiply-adds (its terms in ascending key order) in
 * its own lane, so the width changes no bit; on an Intel core a 512-bit multiply-add
 * costs about what a 256-bit one does. Blocks of NB registers of 16 values. */
typedef void (*values_one_fn)(float *, const float *, int64_t, const float *, int64_t, int64_t, int64_t);
typedef void (*values_two_fn)(float *, float *, const float *, int64_t, const float *, int64_t, const float *,
                              int64_t, int64_t, int64_t);
AVX512F __attribute__((always_inline)) static inline void
values_one_block(float *o, const float *s, int64_t sb, const float *vals, int64_t j0, int64_t j1, int64_t hd,
                 const int NB) {
    __m512 y[8];
    for (int b = 0; b < NB; b++) y[b] = _mm512_loadu_ps(o + 16 * b);
    for (int64_t j = j0; j < j1; j++) {
        const __m512 p = _mm512_set1_ps(s[j - sb]);
        const float *v = vals + j * hd;
        for (int b = 0; b < NB; b++) y[b] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * b), y[b]);
    }
    for (int b = 0; b < NB; b++) _mm512_storeu_ps(o + 16 * b, y[b]);
}
AVX512F static void values_one_512(float *o, const float *s, int64_t sb, const float *vals, int64_t j0,
                                   int64_t j1, int64_t hd) {
    int64_t i0 = 0;
    for (; i0 + 128 <= hd; i0 += 128) values_one_block(o + i0, s, sb, vals + i0, j0, j1, hd, 8);
    if (i0 + 64 <= hd) values_one_block(o + i0, s, sb, vals + i0, j0, j1, hd, 4), i0 += 64;
    if (i0 + 32 <= hd) values_one_block(o + i0, s, sb, vals + i0, j0, j1, hd, 2), i0 += 32;
    if (i0 + 16 <= hd) values_one_block(o + i0, s, sb, vals + i0, j0, j1, hd, 1), i0 += 16;
    if (i0 < hd) values_one8(o, s, sb, vals, j0, j1, hd, i0); /* the last 8 values */
}
AVX512F __attribute__((always_inline)) static inline void
values_two_block(float *o0, float *o1, const float *s0, int64_t b0, const float *s1, int64_t b1,
                 const float *vals, int64_t j0, int64_t j1, int64_t hd, const int NB) {
    __m512 y[4], z[4];
    for (int b = 0; b < NB; b++) {
        y[b] = _mm512_loadu_ps(o0 + 16 * b);
        z[b] = _mm512_loadu_ps(o1 + 16 * b);
    }
    for (int64_t j = j0; j < j1; j++) {
        const __m512 p0 = _mm512_set1_ps(s0[j - b0]), p1 = _mm512_set1_ps(s1[j - b1]);
        const float *v = vals + j * hd;
        for (int b = 0; b < NB; b++) {
            const __m512 vv = _mm512_loadu_ps(v + 16 * b);
            y[b] = _mm512_fmadd_ps(p0, vv, y[b]);
            z[b] = _mm512_fmadd_ps(p1, vv, z[b]);
        }
    }
    for (int b = 0; b < NB; b++) {
        _mm512_storeu_ps(o0 + 16 * b, y[b]);
        _mm512_storeu_ps(o1 + 16 * b, z[b]);
    }
}
AVX512F static void values_two_512(float *o0, float *o1, const float *s0, int64_t b0, const float *s1,
                                   int64_t b1, const float *vals, int64_t j0, int64_t j1, int64_t hd) {
    int64_t i0 = 0;
    for (; i0 + 64 <= hd; i0 += 64) values_two_block(o0 + i0, o1 + i0, s0, b0, s1, b1, vals + i0, j0, j1, hd, 4);
    if (i0 + 32 <= hd) values_two_block(o0 + i0, o1 + i0, s0, b0, s1, b1, vals + i0, j0, j1, hd, 2), i0 += 32;
    if (i0 + 16 <= hd) values_two_block(o0 + i0, o1 + i0, s0, b0, s1, b1, vals + i0, j0, j1, hd, 1), i0 += 16;
    if (i0 < hd) values_two8(o0, o1, s0, b0, s1, b1, vals, j0, j1, hd, i0); /* the last 8 values */
}

/* scores_one and scores_two in 512-bit registers (lanes 0-15 of dot16_portable in one
 * register, a last 8 elements into lanes 0-7), for the AVX-512 paths */
typedef void (*scores_one_fn)(const float *, const float *, int64_t, int64_t, int64_t, float, float *, int64_t);
typedef void (*scores_two_fn)(const float *, const float *, const float *, int64_t, int64_t, int64_t, float,
                              float *, int64_t, float *, int64_t);
AVX512F static inline __m256 fold16(__m512 a) { /* lane l + lane l + 8 */
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
AVX512F static inline __m512 fma_low8(const float *a, const float *b, __m512 acc) {
    return _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(_mm256_loadu_ps(a)),
                                 _mm512_castps256_ps512(_mm256_loadu_ps(b)), acc, 0xFF);
}
AVX512F static void scores_one_512(const float *q, const float *keys, int64_t j0, int64_t j1, int64_t hd,
                                   float scale, float *s, int64_t sb) {
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        const float *k0 = keys + j * hd;
        __m512 a[4];
        for (int e = 0; e < 4; e++) a[e] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= hd; i += 16) {
            const __m512 qv = _mm512_loadu_ps(q + i);
            for (int e = 0; e < 4; e++) a[e] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + e * hd + i), a[e]);
        }
        if (i < hd)
            for (int e = 0; e < 4; e++) a[e] = fma_low8(q + i, k0 + e * hd + i, a[e]);
        const __m128 sums = hsum8x4_avx(fold16(a[0]), fold16(a[1]), fold16(a[2]), fold16(a[3]));
        _mm_storeu_ps(s + j - sb, _mm_mul_ps(sums, _mm_set1_ps(scale)));
    }
    for (; j < j1; j++) s[j - sb] = dot16_avx2(q, keys + j * hd, hd) * scale;
}
AVX512F static void scores_two_512(const float *q0, const float *q1, const float *keys, int64_t j0, int64_t j1,
                                   int64_t hd, float scale, float *s0, int64_t b0, float *s1, int64_t b1) {
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        const float *k0 = keys + j * hd;
        __m512 a[4], b[4];
        for (int e = 0; e < 4; e++) a[e] = b[e] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= hd; i += 16) {
            const __m512 qa = _mm512_loadu_ps(q0 + i), qb = _mm512_loadu_ps(q1 + i);
            for (int e = 0; e < 4; e++) {
                const __m512 kv = _mm512_loadu_ps(k0 + e * hd + i);
                a[e] = _mm512_fmadd_ps(qa, kv, a[e]);
                b[e] = _mm512_fmadd_ps(qb, kv, b[e]);
            }
        }
        if (i < hd)
            for (int e = 0; e < 4; e++) {
                a[e] = fma_low8(q0 + i, k0 + e * hd + i, a[e]);
                b[e] = fma_low8(q1 + i, k0 + e * hd + i, b[e]);
            }
        const __m128 sa = hsum8x4_avx(fold16(a[0]), fold16(a[1]), fold16(a[2]), fold16(a[3]));
        const __m128 sb_ = hsum8x4_avx(fold16(b[0]), fold16(b[1]), fold16(b[2]), fold16(b[3]));
        _mm_storeu_ps(s0 + j - b0, _mm_mul_ps(sa, _mm_set1_ps(scale)));
        _mm_storeu_ps(s1 + j - b1, _mm_mul_ps(sb_, _mm_set1_ps(scale)));
    }
    for (; j < j1; j++) {
        s0[j - b0] = dot16_avx2(q0, keys + j * hd, hd) * scale;
        s1[j - b1] = dot16_avx2(q1, keys + j * hd, hd) * scale;
    }
}

/* Scores of four queries that share a key range, 4 keys at a time: the 16 (query, key)
 * sums are dot16_portable's 16 lanes each, as in scores_one_512, but their lanes are
 * added by a transpose network (lanes l and l + 8 of two sums side by side, then
 * hsum8_x16: hsum8's tree after lane l + lane l + 8, exactly) that ends with the 16
 * scores in one register, query r's 4 in its quarter r; 45 shuffles and adds for 16
 * scores where folding each sum alone takes twice that, and each key load serves four
 * queries. */
typedef void (*scores_four_fn)(const float *const *, const float *, int64_t, int64_t, int64_t, float,
                               float *const *, const int64_t *);
AVX512F static void scores_four_512(const float *const *q, const float *keys, int64_t j0, int64_t j1,
                                    int64_t hd, float scale, float *const *s, const int64_t *sb) {
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        const float *k0 = keys + j * hd;
        __m512 a[16]; /* a[4e + r]: key j + e, query r */
        for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= hd; i += 16) {
            __m512 qv[4];
            for (int r = 0; r < 4; r++) qv[r] = _mm512_loadu_ps(q[r] + i);
            for (int e = 0; e < 4; e++) {
                const __m512 kv = _mm512_loadu_ps(k0 + e * hd + i);
                for (int r = 0; r < 4; r++) a[4 * e + r] = _mm512_fmadd_ps(qv[r], kv, a[4 * e + r]);
            }
        }
        if (i < hd)
            for (int e = 0; e < 4; e++)
                for (int r = 0; r < 4; r++) a[4 * e + r] = fma_low8(q[r] + i, k0 + e * hd + i, a[4 * e + r]);
        __m512 t[8];
        for (int k = 0; k < 8; k++) /* lanes 0-7 of a[2k] and a[2k + 1] + their lanes 8-15 */
            t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                                 _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
        /* a[4e + r]'s sum is group (r & 1) of t[2e + r / 2]: lane 4 (r & 1) + 8 (r / 2) + e
         * by hsum8_x16, that is quarter r, key e */
        const __m512 z = _mm512_mul_ps(hsum8_x16(t), _mm512_set1_ps(scale));
        _mm_storeu_ps(s[0] + j - sb[0], _mm512_castps512_ps128(z));
        _mm_storeu_ps(s[1] + j - sb[1], _mm512_extractf32x4_ps(z, 1));
        _mm_storeu_ps(s[2] + j - sb[2], _mm512_extractf32x4_ps(z, 2));
        _mm_storeu_ps(s[3] + j - sb[3], _mm512_extractf32x4_ps(z, 3));
    }
    for (; j < j1; j++)
        for (int r = 0; r < 4; r++) s[r][j - sb[r]] = dot16_avx2(q[r], keys + j * hd, hd) * scale;
}

/* values_one_512 for four queries that share a key range: each value load serves four
 * output rows (the same chains of fused multiply-adds, keys in ascending order) */
typedef void (*values_four_fn)(float *const *, const float *const *, const int64_t *, const float *, int64_t,
                               int64_t, int64_t);
AVX512F __attribute__((always_inline)) static inline void
values_four_block(float *const *o, const float *const *s, const int64_t *sb, const float *vals, int64_t j0,
                  int64_t j1, int64_t hd, int64_t i0, const int NB) {
    __m512 y[4][4];
    for (int r = 0; r < 4; r++)
        for (int b = 0; b < NB; b++) y[r][b] = _mm512_loadu_ps(o[r] + i0 + 16 * b);
    for (int64_t j = j0; j < j1; j++) {
        const float *v = vals + j * hd + i0;
        __m512 vv[4];
        for (int b = 0; b < NB; b++) vv[b] = _mm512_loadu_ps(v + 16 * b);
        for (int r = 0; r < 4; r++) {
            const __m512 p = _mm512_set1_ps(s[r][j - sb[r]]);
            for (int b = 0; b < NB; b++) y[r][b] = _mm512_fmadd_ps(p, vv[b], y[r][b]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(o[r] + i0 + 16 * b, y[r][b]);
}
AVX512F static void values_four_512(float *const *o, const float *const *s, const int64_t *sb,
                                    const float *vals, int64_t j0, int64_t j1, int64_t hd) {
    int64_t i0 = 0;
    for (; i0 + 64 <= hd; i0 += 64) values_four_block(o, s, sb, vals, j0, j1, hd, i0, 4);
    if (i0 + 32 <= hd) values_four_block(o, s, sb, vals, j0, j1, hd, i0, 2), i0 += 32;
    if (i0 + 16 <= hd) values_four_block(o, s, sb, vals, j0, j1, hd, i0, 1), i0 += 16;
    if (i0 < hd) /* the last 8 values */
        for (int r = 0; r < 4; r++) values_one8(o[r], s[r], sb[r], vals, j0, j1, hd, i0);
}

/* The vector code attention runs: 256- or 512-bit (attention_512 on an AVX-512 path) */
typedef struct attn_code {
    scores_one_fn k1;
    scores_two_fn k2;
    values_one_fn v1;
    values_two_fn v2;
    scores_four_fn k4; /* four queries at once (NULL: pairs and one at a time) */
    values_four_fn v4;
} attn_code_t;
static const attn_code_t attn_256 = {scores_one, scores_two, values_one, values_two, NULL, NULL};
static const attn_code_t attn_512 = {scores_one_512, scores_two_512, values_one_512,
                                     values_two_512, scores_four_512, values_four_512};

/* One key/value group's cache as the vector code reads it. A float32 cache is read in
 * place (kb, vb: the group's rows, never changed; f = 0 below); a float16 one is widened a
 * block of keys at a time into a per-thread buffer (kb, vb: the block, whose first key is
 * f). */
typedef struct {
    const float *kb, *vb;
    const uint16_t *k16, *v16;
    float *buf; /* KEY_BLOCK keys, then KEY_BLOCK values */
    int path;
} kv_group_t;
static int kv_group(const attn_t *a, int64_t g, kv_group_t *kv) {
    const int64_t at = g * a->rows * a->hd;
    memset(kv, 0, sizeof *kv);
    kv->path = a->path;
    if (!a->k16) {
        kv->kb = a->k + at;
        kv->vb = a->v + at;
        return 0;
    }
    kv->k16 = a->k16 + at, kv->v16 = a->v16 + at;
    kv->buf = scratch_get(&t_kv_scratch, (int64_t)sizeof(float) * 2 * KEY_BLOCK * a->hd);
    return kv->buf ? 0 : -1;
}
/* keys j0 .. j1 - 1 (at most KEY_BLOCK of them) ready in kv->kb; returns f, the key at
 * kv->kb's first row (key j at kv->kb + (j - f) * hd) */
static inline int64_t kv_keys(kv_group_t *kv, int64_t j0, int64_t j1, int64_t hd) {
    if (!kv->k16) return 0;
    kv_widen(kv->k16, j0, j1, hd, kv->buf, kv->path);
    kv->kb = kv->buf;
    return j0;
}
/* the queries' score offsets for a block whose first key is f: bf itself for a float32
 * cache (f = 0), else bf - f in out */
static inline const int64_t *kv_bases(const int64_t *bf, int64_t n, int64_t f, int64_t *out) {
    if (!f) return bf;
    for (int64_t i = 0; i < n; i++) out[i] = bf[i] - f;
    return out;
}
static inline int64_t kv_values(kv_group_t *kv, int64_t j0, int64_t j1, int64_t hd) {
    if (!kv->v16) return 0;
    kv_widen(kv->v16, j0, j1, hd, kv->buf + KEY_BLOCK * hd, kv->path);
    kv->vb = kv->buf + KEY_BLOCK * hd;
    return j0;
}

/* The query heads of one key/value group at one query row (chunk = g * T + t), the vector
 * code of every path from AVX2 on (the 512-bit code with attention_512, else the 256-bit).
 * Every (head, row) pair gets bitwise what attend_one computes for it: each score is the
 * same 8-lane sum of fused multiply-adds, the softmax the same exp_neg and 8-lane sum, and
 * each output value adds its terms (fused multiply-adds) in ascending key order. What differs is only the layout: the group's
 * heads (up to GROUP_HEADS at a time) take a block of KEY_BLOCK keys in turn while it is
 * in L1, so a long cache is read from memory once per group rather than once per head
 * (grouped-query attention shares keys among 2-7 heads); scores are formed 4 keys at a
 * time (independent chains); and a value block's weighted sums stay in registers across
 * the block's keys, 64 values at a time, carried in the output between blocks. */
AVX2 static void attend_group(const void *ctx, int64_t chunk) {
    const attn_t *a = ctx;
    const int64_t g = chunk / a->T, t = chunk % a->T, hd = a->hd;
    const int64_t per = a->nh / a->nkv;
    const int64_t lo = a->lo[t], hi = a->hi[t], n = hi - lo;
    kv_group_t kv;
    const attn_code_t *code = a->code;
    const scores_one_fn k1 = code->k1;
    const values_one_fn v1 = code->v1;
    float *sc = scratch_get(&t_attn_scratch, (int64_t)sizeof(float) * GROUP_HEADS * (n > 0 ? n : 0));
    if ((!sc && n > 0) || kv_group(a, g, &kv)) {
        atomic_store(&((attn_t *)a)->failed, 1);
        return;
    }
    for (int64_t h0 = g * per; h0 < (g + 1) * per; h0 += GROUP_HEADS) {
        const int64_t H = (g + 1) * per - h0 < GROUP_HEADS ? (g + 1) * per - h0 : GROUP_HEADS;
        const float *q[GROUP_HEADS];
        float *o[GROUP_HEADS], sum[GROUP_HEADS];
        for (int64_t x = 0; x < H; x++) {
            q[x] = a->q + t * a->q_t + (h0 + x) * a->q_h;
            o[x] = a->out + t * a->o_t + (h0 + x) * a->o_h;
            for (int64_t i = 0; i < hd; i++) o[x][i] = 0.0f;
        }
        if (n <= 0) continue;
        /* a float16 cache's row alone: four heads at a time (each key and value load,
         * from the widened block in L1, serves four heads; the same bits). A float32
         * cache's keys and values come from memory, where this measured slower. */
        const int four = code->k4 && kv.k16 && H >= 4;
        for (int64_t j0 = lo; j0 < hi; j0 += KEY_BLOCK) {
            const int64_t j1 = j0 + KEY_BLOCK < hi ? j0 + KEY_BLOCK : hi;
            const int64_t f = kv_keys(&kv, j0, j1, hd); /* keys j at kv.kb + (j - f) hd */
            int64_t x = 0;
            if (four)
                for (; x + 4 <= H; x += 4) {
                    float *const sx[4] = {sc + x * n, sc + (x + 1) * n, sc + (x + 2) * n, sc + (x + 3) * n};
                    const int64_t bx[4] = {lo - f, lo - f, lo - f, lo - f};
                    code->k4(q + x, kv.kb, j0 - f, j1 - f, hd, a->scale, sx, bx);
                }
            for (; x < H; x++) k1(q[x], kv.kb, j0 - f, j1 - f, hd, a->scale, sc + x * n, lo - f);
        }
        for (int64_t x = 0; x < H; x++) {
            softcap_scores(sc + x * n, n, a->softcap);
            sum[x] = softmax_avx2(sc + x * n, n);
        }
        for (int64_t j0 = lo; j0 < hi; j0 += KEY_BLOCK) {
            const int64_t j1 = j0 + KEY_BLOCK < hi ? j0 + KEY_BLOCK : hi;
            const int64_t f = kv_values(&kv, j0, j1, hd);
            int64_t x = 0;
            if (four)
                for (; x + 4 <= H; x += 4) {
                    const float *const sx[4] = {sc + x * n, sc + (x + 1) * n, sc + (x + 2) * n, sc + (x + 3) * n};
                    const int64_t bx[4] = {lo - f, lo - f, lo - f, lo - f};
                    code->v4(o + x, sx, bx, kv.vb, j0 - f, j1 - f, hd);
                }
            for (; x < H; x++) v1(o[x], sc + x * n, lo - f, kv.vb, j0 - f, j1 - f, hd);
        }
        for (int64_t x = 0; x < H; x++)
            for (int64_t i = 0; i < hd; i++) o[x][i] = o[x][i] / sum[x];
    }
}

/* k1 over keys j0 .. j1 - 1 of a group (a float16 cache's a block at a time) */
AVX2 static void scores_range(kv_group_t *kv, scores_one_fn k1, const float *q, int64_t j0, int64_t j1,
                              int64_t hd, float scale, float *s, int64_t sb) {
    if (!kv->k16) {
        k1(q, kv->kb, j0, j1, hd, scale, s, sb);
        return;
    }
    for (int64_t b0 = j0; b0 < j1; b0 += KEY_BLOCK) {
        const int64_t b1 = b0 + KEY_BLOCK < j1 ? b0 + KEY_BLOCK : j1, f = kv_keys(kv, b0, b1, hd);
        k1(q, kv->kb, b0 - f, b1 - f, hd, scale, s, sb - f);
    }
}
/* v1 over keys j0 .. j1 - 1 of a group, in ascending order (so the same chains) */
AVX2 static void values_range(kv_group_t *kv, values_one_fn v1, float *o, const float *s, int64_t sb, int64_t j0,
                              int64_t j1, int64_t hd) {
    if (!kv->v16) {
        v1(o, s, sb, kv->vb, j0, j1, hd);
        return;
    }
    for (int64_t b0 = j0; b0 < j1; b0 += KEY_BLOCK) {
        const int64_t b1 = b0 + KEY_BLOCK < j1 ? b0 + KEY_BLOCK : j1, f = kv_values(kv, b0, b1, hd);
        v1(o, s, sb - f, kv->vb, b0 - f, b1 - f, hd);
    }
}

/* Up to 2 ATTN_MAX_PAIRS query rows of a pass (a->pairs pairs) in one key/value
 * group: bitwise what attend_group computes for each row (each score the same chain of
 * fused multiply-adds, each output value its terms in ascending key order), but the keys
 * and values every row sees are taken a block at a time for all the rows and heads while
 * the block is in L1, so a long cache is read from memory once per block of rows, and
 * four (head, row) queries share each key and value load (scores_four, values_four; two
 * on the 256-bit code: scores_two, values_two). A row's keys outside the shared range
 * go as attend_group's. chunk = g * blocks + block. */
AVX2 static void attend_rows(const void *ctx, int64_t chunk) {
    const attn_t *a = ctx;
    const int64_t RB = 2 * a->pairs, blocks = (a->T + RB - 1) / RB;
    const int64_t g = chunk / blocks, t0 = chunk % blocks * RB, R = a->T - t0 < RB ? a->T - t0 : RB;
    int64_t lo[2 * ATTN_MAX_PAIRS], hi[2 * ATTN_MAX_PAIRS], at[2 * ATTN_MAX_PAIRS];
    int64_t slo = 0, shi = INT64_MAX, tot = 0; /* keys [slo, shi) every row sees */
    for (int64_t r = 0; r < R; r++) {
        lo[r] = a->lo[t0 + r];
        hi[r] = a->hi[t0 + r] > lo[r] ? a->hi[t0 + r] : lo[r];
        at[r] = tot;
        tot += hi[r] - lo[r];
        slo = lo[r] > slo ? lo[r] : slo;
        shi = hi[r] < shi ? hi[r] : shi;
    }
    if (R == 1 || shi - slo < 4) {
        for (int64_t r = 0; r < R; r++) attend_group(ctx, g * a->T + t0 + r);
        return;
    }
    const int64_t hd = a->hd, per = a->nh / a->nkv;
    kv_group_t kv;
    const attn_code_t *code = a->code;
    const scores_one_fn k1 = code->k1;
    const scores_two_fn k2 = code->k2;
    const values_one_fn v1 = code->v1;
    const values_two_fn v2 = code->v2;
    float *sc = scratch_get(&t_attn_scratch, (int64_t)sizeof(float) * GROUP_HEADS * tot);
    if (!sc || kv_group(a, g, &kv)) {
        atomic_store(&((attn_t *)a)->failed, 1);
        return;
    }
    for (int64_t h0 = g * per; h0 < (g + 1) * per; h0 += GROUP_HEADS) {
        const int64_t H = (g + 1) * per - h0 < GROUP_HEADS ? (g + 1) * per - h0 : GROUP_HEADS;
        const float *q[GROUP_HEADS][2 * ATTN_MAX_PAIRS];
        float *o[GROUP_HEADS][2 * ATTN_MAX_PAIRS], *s[GROUP_HEADS][2 * ATTN_MAX_PAIRS];
        float sum[GROUP_HEADS][2 * ATTN_MAX_PAIRS];
        for (int64_t x = 0; x < H; x++)
            for (int64_t r = 0; r < R; r++) {
                q[x][r] = a->q + (t0 + r) * a->q_t + (h0 + x) * a->q_h;
                o[x][r] = a->out + (t0 + r) * a->o_t + (h0 + x) * a->o_h;
                s[x][r] = sc + x * tot + at[r]; /* key j at s[x][r][j - lo[r]] */
                for (int64_t i = 0; i < hd; i++) o[x][r][i] = 0.0f;
            }
        /* scores: each row's own keys before and after the shared ones, then the shared
         * ones a block at a time for every head and row */
        for (int64_t x = 0; x < H; x++)
            for (int64_t r = 0; r < R; r++) {
                scores_range(&kv, k1, q[x][r], lo[r], slo, hd, a->scale, s[x][r], lo[r]);
                scores_range(&kv, k1, q[x][r], shi, hi[r], hd, a->scale, s[x][r], lo[r]);
            }
        /* over the shared keys every (head, row) is one query: four at a time where the
         * code has it, then pairs, then one (a row alone, attend_group, keeps its heads
         * one at a time over a float32 cache: one row's pass after 4,000 tokens measured
         * 1.02-1.06x the time with four heads at a time, its keys and values then coming
         * from memory; over a float16 cache, widened into L1, it takes four) */
        const int64_t NQ = H * R, N4 = code->k4 ? NQ / 4 * 4 : 0;
        const float *qf[GROUP_HEADS * 2 * ATTN_MAX_PAIRS];
        float *of[GROUP_HEADS * 2 * ATTN_MAX_PAIRS], *sf[GROUP_HEADS * 2 * ATTN_MAX_PAIRS];
        int64_t bf[GROUP_HEADS * 2 * ATTN_MAX_PAIRS], bb[GROUP_HEADS * 2 * ATTN_MAX_PAIRS];
        for (int64_t x = 0; x < H; x++)
            for (int64_t r = 0; r < R; r++)
                qf[x * R + r] = q[x][r], of[x * R + r] = o[x][r], sf[x * R + r] = s[x][r], bf[x * R + r] = lo[r];
        for (int64_t j0 = slo; j0 < shi; j0 += KEY_BLOCK) {
            const int64_t j1 = j0 + KEY_BLOCK < shi ? j0 + KEY_BLOCK : shi;
            const int64_t f = kv_keys(&kv, j0, j1, hd), b0 = j0 - f, b1 = j1 - f;
            const float *keys = kv.kb;
            const int64_t *sb = kv_bases(bf, NQ, f, bb);
            int64_t i = 0;
            for (; i < N4; i += 4) code->k4(qf + i, keys, b0, b1, hd, a->scale, sf + i, sb + i);
            for (; i + 1 < NQ; i += 2) k2(qf[i], qf[i + 1], keys, b0, b1, hd, a->scale, sf[i], sb[i], sf[i + 1], sb[i + 1]);
            if (i < NQ) k1(qf[i], keys, b0, b1, hd, a->scale, sf[i], sb[i]);
        }
        for (int64_t x = 0; x < H; x++)
            for (int64_t r = 0; r < R; r++) {
                softcap_scores(s[x][r], hi[r] - lo[r], a->softcap);
                sum[x][r] = softmax_avx2(s[x][r], hi[r] - lo[r]);
            }
        /* values in ascending key order for each row: its own keys before the shared ones,
         * the shared ones (a block at a time, every row), its own keys after */
        for (int64_t x = 0; x < H; x++)
            for (int64_t r = 0; r < R; r++) values_range(&kv, v1, o[x][r], s[x][r], lo[r], lo[r], slo, hd);
        for (int64_t j0 = slo; j0 < shi; j0 += KEY_BLOCK) {
            const int64_t j1 = j0 + KEY_BLOCK < shi ? j0 + KEY_BLOCK : shi;
            const int64_t f = kv_values(&kv, j0, j1, hd), b0 = j0 - f, b1 = j1 - f;
            const float *vals = kv.vb;
            const int64_t *sb = kv_bases(bf, NQ, f, bb);
            int64_t i = 0;
            for (; i < N4; i += 4) code->v4(of + i, (const float *const *)(sf + i), sb + i, vals, b0, b1, hd);
            for (; i + 1 < NQ; i += 2) v2(of[i], of[i + 1], sf[i], sb[i], sf[i + 1], sb[i + 1], vals, b0, b1, hd);
            if (i < NQ) v1(of[i], sf[i], sb[i], vals, b0, b1, hd);
        }
        for (int64_t x = 0; x < H; x++)
            for (int64_t r = 0; r < R; r++) {
                values_range(&kv, v1, o[x][r], s[x][r], lo[r], shi, hi[r], hd);
                for (int64_t i = 0; i < hd; i++) o[x][r][i] = o[x][r][i] / sum[x][r];
            }
    }
}
#endif

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
#ifdef SPEC_X86
    if (a->path >= PATH_AVX2) {
        a->code = a->path >= PATH_AVX512 && g_attn_512 ? &attn_512 : &attn_256;
        int64_t pairs = T / 32;
        /* a long cache (its keys and values past L2): every thread's share of a group's
         * rows in one task, so that the cache is read once per task, not once per pair */
        const int64_t keys = hi[T - 1] - lo[T - 1];
        if (keys >= g_attn_long_keys) {
            const int64_t per_group = (nthreads + a->nkv - 1) / a->nkv; /* tasks a group wants */
            const int64_t spread = (T + 2 * per_group - 1) / (2 * per_group);
            if (spread > pairs) pairs = spread;
        }
        a->pairs = pairs < g_attn_pairs ? pairs : g_attn_pairs;
        if (a->pairs < 1) a->pairs = 1;
        jb.task = g_attn_pairs && T > 1 ? attend_rows : attend_group;
        jb.nchunks = g_attn_pairs && T > 1 ? a->nkv * ((T + 2 * a->pairs - 1) / (2 * a->pairs)) : a->nkv * T;
    }
#endif
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

/* k, v: float32, or float16 with kv16 (a cache of kv_dtype float16) */
int spec_attend(const float *q, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const void *k,
                const void *v, int64_t rows, const int64_t *lo, const int64_t *hi, float scale,
                float softcap, float *out, int nthreads, int kv16) {
    if (hd <= 0 || hd % 8 || nkv <= 0 || nh % nkv || !ranges_ok(T, lo, hi, rows)) return -1;
    attn_t a = {q, kv16 ? NULL : k, kv16 ? NULL : v, out, T, nh, nkv, hd, rows, hd, T * hd, hd, T * hd, lo, hi,
                scale, resolve_path(), 0, 0, NULL, kv16 ? k : NULL, kv16 ? v : NULL, softcap};
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
 * the values to cache rows start .. start+T-1 of kc / vc [nkv][rows][hd] (float32, or
 * float16 with kv16: rounded to nearest even), then attends (query row t sees keys
 * [lo[t], hi[t])) into out [T][nh * hd]. */
int spec_rope_attend(const float *qkv, int64_t T, int64_t ld, int64_t nh, int64_t nkv, int64_t hd,
                     const float *cos, const float *sin, void *kc, void *vc, int64_t rows,
                     int64_t start, const int64_t *lo, const int64_t *hi, float scale,
                     float softcap, float *out, int nthreads, int kv16) {
    if (hd <= 0 || hd % 8 || nkv <= 0 || nh % nkv || ld < (nh + 2 * nkv) * hd) return -1;
    if (start < 0 || start + T > rows || !ranges_ok(T, lo, hi, rows)) return -1;
    const int path = resolve_path();
    float *qr = malloc(sizeof(float) * (size_t)(T * nh * hd + (kv16 ? hd : 0)));
    if (!qr) return -4;
    float *kr = qr + T * nh * hd; /* a roped key row before its rounding (kv16) */
    for (int64_t t = 0; t < T; t++) {
        const float *row = qkv + t * ld, *c = cos + t * hd, *s = sin + t * hd;
        for (int64_t h = 0; h < nh; h++) rope_head(row + h * hd, c, s, hd, qr + (t * nh + h) * hd);
        for (int64_t g = 0; g < nkv; g++) {
            const int64_t at = (g * rows + start + t) * hd;
            const float *vs = row + (nh + nkv + g) * hd;
            if (kv16) {
                rope_head(row + (nh + g) * hd, c, s, hd, kr);
                kv_narrow(kr, hd, (uint16_t *)kc + at, path);
                kv_narrow(vs, hd, (uint16_t *)vc + at, path);
            } else {
                rope_head(row + (nh + g) * hd, c, s, hd, (float *)kc + at);
                memcpy((float *)vc + at, vs, sizeof(float) * (size_t)hd);
            }
        }
    }
    attn_t a = {qr, kv16 ? NULL : kc, kv16 ? NULL : vc, out, T, nh, nkv, hd, rows, nh * hd, hd, nh * hd, hd, lo,
                hi, scale, path, 0, 0, NULL, kv16 ? kc : NULL, kv16 ? vc : NULL, softcap};
    int rc = run_attention(&a, nthreads);
    free(qr);
    return rc;
}

/* y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows of d values (d a multiple of 8). */
int spec_rms_norm(const float *x, const float *w, int64_t m, int64_t d, float eps, float *y) {
    if (d <= 0 || d % 8) return -1;
#ifdef SPEC_X86
    const int path = resolve_path();
#endif
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

/* ------------------------------------------------------------ the gated activation */
/* out[r][j] = silu(g) * u with g = gu[r][j], u = gu[r][F + j] (gu [m][2F]): silu(g) =
 * g / (1 + exp(-g)), formed as g * s with s = 1 / (1 + e) for g >= 0 and e / (1 + e)
 * below, e = exp(-|g|) (exp_neg: never overflows). The vector code does the same float
 * operations, so both paths give the same bits; each value depends on its inputs only. */
static inline float silu_mul1(float g, float u) {
    const float e = exp_neg(-fabsf(g));
    const float s = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
    return (g * s) * u;
}

#ifdef SPEC_X86
AVX2 static void silu_mul_avx2(const float *g, const float *u, float *out, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 e = exp8_avx2(_mm256_or_ps(gv, sign)); /* -|g| */
        /* NaN: exp8 passes it on, as exp_neg does, and the compare below is false */
        const __m256 pos = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ);
        const __m256 s = _mm256_div_ps(_mm256_blendv_ps(e, one, pos), _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(gv, s), _mm256_loadu_ps(u + j)));
    }
    for (; j < n; j++) out[j] = silu_mul1(g[j], u[j]);
}
#endif

static void silu_mul_rows(const float *gu, int64_t r0, int64_t r1, int64_t F, float *out,
                          int path) {
    for (int64_t r = r0; r < r1; r++) {
        const float *g = gu + r * 2 * F, *u = g + F;
        float *o = out + r * F;
#ifdef SPEC_X86
        if (path >= PATH_AVX2) {
            silu_mul_avx2(g, u, o, F);
            continue;
        }
#endif
        for (int64_t j = 0; j < F; j++) o[j] = silu_mul1(g[j], u[j]);
    }
    (void)path;
}

typedef struct {
    const float *gu;
    int64_t F;
    float *out;
    int path;
} silu_t;

static void silu_part(const void *ctx, int64_t r0, int64_t r1) {
    const silu_t *a = ctx;
    silu_mul_rows(a->gu, r0, r1, a->F, a->out, a->path);
}

/* rows in chunks over the threads (each value depends on its inputs only) */
static int silu_mul_threads(const float *gu, int64_t m, int64_t F, float *out, int nthreads) {
    if (m < 0 || F < 0) return -1;
    const silu_t a = {gu, F, out, resolve_path()};
    run_rows(m, ROW_CHUNK, silu_part, &a, nthreads);
    return 0;
}

int spec_silu_mul(const float *gu, int64_t m, int64_t F, float *out) {
    return silu_mul_threads(gu, m, F, out, 1);
}

/* ------------------------------------------------------- whole layers in one call */
/* A projection as spec_linear takes it, with an optional bias added to its output. */
typedef struct {
    int32_t nparts;
    int32_t types[MAX_PARTS];
    const void *w[MAX_PARTS];
    int64_t ns[MAX_PARTS];
    int64_t K, n;
    const float *bias; /* [n] or NULL */
} spec_mat_t;

/* One pre-norm decoder layer (Llama / Qwen2): attention and a SiLU-gated MLP, each
 * behind an RMS norm and added to the residual stream. */
typedef struct {
    const float *attn_norm, *ffn_norm; /* [dim] */
    spec_mat_t qkv, wo, gate_up, down;
} spec_layer_t;

/* One sequence's rows in the pass: its cache (layer l's keys at k + l * layer_stride,
 * [nkv][rows][hd]) and where its T rows go. */
typedef struct {
    int64_t T;
    void *k, *v; /* float32, or float16 with kv16 */
    int64_t rows, start, layer_stride;
    int64_t kv16;
} spec_seg_t;

static int mat_apply(const spec_mat_t *mt, const float *x, int64_t m, float *y, int nthreads) {
    int rc = spec_linear(mt->nparts, mt->types, mt->w, mt->ns, mt->K, x, m, y, mt->n, nthreads);
    if (rc != 0 || !mt->bias) return rc;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < mt->n; c++) y[r * mt->n + c] = y[r * mt->n + c] + mt->bias[c];
    return 0;
}

/* The layers [0, nlayers) over the m rows x [m][dim] (updated in place) of nseg sequences,
 * rows in segment order; cos / sin [m][hd] of each row's position, lo / hi [m] the keys
 * each row sees. Each step is the decoder's own (the same calls, in the same order), so
 * the results are bitwise those of running the layers one operation at a time.
 * Returns 0, or the first failing step's negative code. */
int spec_layers(const spec_layer_t *layers, int64_t nlayers, int64_t dim, int64_t nh, int64_t nkv,
                int64_t hd, float eps, float scale, float *x, int64_t m, const spec_seg_t *segs,
                int64_t nseg, const float *cos, const float *sin, const int64_t *lo,
                const int64_t *hi, int nthreads) {
    if (m <= 0 || nlayers <= 0) return 0;
    int64_t total = 0;
    for (int64_t s = 0; s < nseg; s++) total += segs[s].T;
    if (total != m) return -1;
    const int64_t ldqkv = layers[0].qkv.n, F2 = layers[0].gate_up.n;
    int64_t width = ldqkv > F2 ? ldqkv : F2;
    if (nh * hd > width) width = nh * hd;
    if (dim > width) width = dim;
    /* h: the normed rows; a: a projection's output; b: the attention / activation rows */
    float *h = malloc(sizeof(float) * (size_t)(m * dim));
    float *a = malloc(sizeof(float) * (size_t)(m * width));
    float *b = malloc(sizeof(float) * (size_t)(m * width));
    int rc = (!h || !a || !b) ? -4 : 0;
    for (int64_t l = 0; l < nlayers && rc == 0; l++) {
        const spec_layer_t *L = &layers[l];
        if (L->qkv.n != ldqkv || L->gate_up.n != F2 || L->wo.n != dim || L->down.n != dim) {
            rc = -1;
            break;
        }
        if ((rc = spec_rms_norm(x, L->attn_norm, m, dim, eps, h))) break;
        if ((rc = mat_apply(&L->qkv, h, m, a, nthreads))) break;
        for (int64_t s = 0, off = 0; s < nseg && rc == 0; off += segs[s].T, s++) {
            const spec_seg_t *sg = &segs[s];
            const int64_t es = sg->kv16 ? 2 : 4, at = l * sg->layer_stride * es; /* bytes */
            rc = spec_rope_attend(a + off * ldqkv, sg->T, ldqkv, nh, nkv, hd, cos + off * hd,
                                  sin + off * hd, (uint8_t *)sg->k + at, (uint8_t *)sg->v + at,
                                  sg->rows, sg->start, lo + off, hi + off, scale, 0.0f,
                                  b + off * nh * hd, nthreads, (int)sg->kv16);
        }
        if (rc) break;
        if ((rc = mat_apply(&L->wo, b, m, a, nthreads))) break;
        for (int64_t i = 0; i < m * dim; i++) x[i] = x[i] + a[i];
        if ((rc = spec_rms_norm(x, L->ffn_norm, m, dim, eps, h))) break;
        if ((rc = mat_apply(&L->gate_up, h, m, a, nthreads))) break;
        if ((rc = silu_mul_threads(a, m, F2 / 2, b, nthreads))) break;
        if ((rc = mat_apply(&L->down, b, m, a, nthreads))) break;
        for (int64_t i = 0; i < m * dim; i++) x[i] = x[i] + a[i];
    }
    free(h);
    free(a);
    free(b);
    return rc;
}

/* ---------------------------------------------------------- weight memory (Linux) */
/* Memory for packed weights: a private anonymous mapping aligned to 2 MiB and marked for
 * transparent huge pages (where the system allows them on request, "madvise"). A decode
 * step streams every weight once; with 4 KiB pages the stream crosses a page (and a
 * TLB entry, and the hardware prefetcher's reach) every 4 KiB. On a Zen 4 EPYC a plain
 * read of 1 GiB with 2 threads measured ~21 GB/s on 4 KiB pages and ~27-29 GB/s on huge
 * pages. Returns NULL where this is not available (the caller then allocates as usual).
 * The mapping's length is nbytes rounded up to 4 KiB; spec_free_weights unmaps it. */
#define HUGE_BYTES ((size_t)2 << 20)
void *spec_alloc_weights(int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (nbytes <= 0) return NULL;
    const size_t len = ((size_t)nbytes + 4095) & ~(size_t)4095;
    uint8_t *raw = mmap(NULL, len + HUGE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                        -1, 0);
    if (raw == MAP_FAILED) return NULL;
    uint8_t *start = (uint8_t *)(((uintptr_t)raw + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1));
    if (start > raw) munmap(raw, (size_t)(start - raw));
    const size_t after = (size_t)(raw + len + HUGE_BYTES - (start + len));
    if (after) munmap(start + len, after);
    madvise(start, len, MADV_HUGEPAGE); /* advice only: refused, the pages stay small */
    return start;
#else
    (void)nbytes;
    return NULL;
#endif
}

void spec_free_weights(void *p, int64_t nbytes) {
#ifdef __linux__
    if (p) munmap(p, ((size_t)nbytes + 4095) & ~(size_t)4095);
#else
    (void)p;
    (void)nbytes;
#endif
}

/* --------------------------------------------------- a module so setuptools builds it */
#ifdef SPEC_PYTHON_MODULE
#include <Python.h>
static struct PyModuleDef spec_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                         "Speculant's native kernels (loaded with ctypes).", -1,
                                         NULL};
PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&spec_module); }
#endif