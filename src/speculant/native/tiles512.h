/*
 * AVX-512 matmul tiles. kernels.c includes this file twice: once for AVX-512 F/BW/VL/DQ
 * (T512_VNNI 0, the kind without VNNI) and once with VNNI (T512_VNNI 1), with T512_ATTR
 * naming the target and T512_FN(name) the suffix of every function defined here.
 *
 * The results are bitwise those of the AVX2 tiles (and so of the portable C code):
 *   - the integer sums of a block are exact in every arrangement; a 512-bit register holds
 *     two 256-bit halves of the AVX2 layout (the low and the high nibbles of a Q4_K chunk,
 *     two Q6_K chunks, two legacy blocks), and the halves are added into the AVX2 lanes;
 *   - VNNI's dot products (vpdpwssd, vpdpbusd) are the same exact integer sums;
 *   - every float operation is the AVX2 tile's, on 256-bit registers, in its order (two
 *     legacy blocks are scaled in one 512-bit multiply, then added one after the other).
 */

#define PIN512(v) __asm__("" : "+v"(v))

/* acc + (the pairwise int16 products of p and s, summed per int32 lane) */
T512_ATTR static inline __m512i T512_FN(madd_acc)(__m512i acc, __m512i p, __m512i s) {
#if T512_VNNI
    return _mm512_dpwssd_epi32(acc, p, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
#endif
}

/* the two 256-bit halves added: the AVX2 tile's 8 lanes */
T512_ATTR static inline __m256i T512_FN(fold)(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* 32 int16 lanes, each 128-bit lane i holding the int16 index pattern that picks int16
 * element e_i of the lane (for vpshufb). */
T512_ATTR static inline __m512i T512_FN(pick16)(int e0, int e1, int e2, int e3) {
#define PICK(e) (int)((uint32_t)((((2 * (e) + 1) << 8) | (2 * (e))) * 0x00010001u))
    return _mm512_set_epi32(PICK(e3), PICK(e3), PICK(e3), PICK(e3), PICK(e2), PICK(e2), PICK(e2),
                            PICK(e2), PICK(e1), PICK(e1), PICK(e1), PICK(e1), PICK(e0), PICK(e0),
                            PICK(e0), PICK(e0));
#undef PICK
}

T512_ATTR __attribute__((always_inline)) static inline void
T512_FN(legacy_tile)(const job_t *jb, const part_t *p, int64_t r0, int R, int64_t c) {
    const int64_t nb = jb->K / 32;
    int per;
    const int bb = type_block(p->type, &per);
    const uint8_t *row = p->w + c * p->row_bytes;
    const int type = p->type;
    const __m512i zero = _mm512_setzero_si512();
#if !T512_VNNI
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    __m256 acc[MAX_ROWS_TILE];
    float accm[MAX_ROWS_TILE];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = 0.0f;
    }
    const xq32 *xbase = jb->x32 + r0 * nb;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        float d0, m0, d1, m1;
        const __m256i w0 = load_legacy_codes(type, row + b * bb, &d0, &m0);
        const __m256i w1 = load_legacy_codes(type, row + (b + 1) * bb, &d1, &m1);
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
#if T512_VNNI
        /* signed codes: sum((x + 128) * w) - 128 * sum(w), the correction shared by all rows */
        const __m512i corr =
            _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8((char)0x80), w));
#else
        /* signed codes: |w| times x with w's sign (vpsignb has no 512-bit form) */
        const __m512i aw = _mm512_abs_epi8(w);
        const __mmask64 neg = _mm512_movepi8_mask(w);
#endif
        for (int r = 0; r < R; r++) {
            const xq32 *xb = xbase + r * nb + b;
            const __m512i x = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)xb[0].q)),
                _mm256_loadu_si256((const __m256i *)xb[1].q), 1);
            __m512i s;
#if T512_VNNI
            if (type == T_Q4_1)
                s = _mm512_dpbusd_epi32(zero, w, x);
            else
                s = _mm512_dpbusd_epi32(corr, _mm512_xor_si512(x, _mm512_set1_epi8((char)0x80)), w);
#else
            if (type == T_Q4_1)
                s = _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones);
            else
                s = _mm512_madd_epi16(
                    _mm512_maddubs_epi16(aw, _mm512_mask_sub_epi8(x, neg, zero, x)), ones);
#endif
            const __m512 f = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d0 * xb[0].d)),
                                                _mm256_set1_ps(d1 * xb[1].d), 1);
            const __m512 prod = _mm512_mul_ps(_mm512_cvtepi32_ps(s), f);
            acc[r] = _mm256_add_ps(acc[r], _mm512_castps512_ps256(prod));
            acc[r] = _mm256_add_ps(acc[r], _mm512_extractf32x8_ps(prod, 1));
            if (type == T_Q4_1) {
                accm[r] = accm[r] + m0 * xb[0].s;
                accm[r] = accm[r] + m1 * xb[1].s;
            }
        }
    }
    if (b < nb) { /* an odd last block: the AVX2 tile's step */
        float d, m;
        const __m256i w = load_legacy_codes(type, row + b * bb, &d, &m);
        for (int r = 0; r < R; r++) {
            const xq32 *xb = xbase + r * nb + b;
            const __m256i x = _mm256_loadu_si256((const __m256i *)xb->q);
            const __m256i s = type == T_Q4_1 ? dot_unsigned(w, x) : dot_signed(w, x);
            const __m256 f = _mm256_set1_ps(d * xb->d);
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

T512_ATTR __attribute__((always_inline)) static inline void
T512_FN(q4k_tile)(const job_t *jb, const part_t *p, int64_t r0, int R, int64_t c) {
    const int64_t nb = jb->K / 256;
    const uint8_t *row = p->w + c * p->row_bytes;
    const __m512i lowmask = _mm512_set1_epi8(0xF);
    __m256 acc[MAX_ROWS_TILE], accm[MAX_ROWS_TILE];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = _mm256_setzero_ps();
    }
    const xq256 *xbase = jb->x256 + r0 * nb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 144;
        const float d = h2f_f16c(rd16(blk)), dmin = h2f_f16c(rd16(blk + 2));
        const uint32_t w0 = rd32(blk + 4), w1 = rd32(blk + 8), w2 = rd32(blk + 12);
        const uint32_t sc_lo = w0 & 0x3f3f3f3fu, mn_lo = w1 & 0x3f3f3f3fu;
        const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
        const uint32_t mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
        const __m512i scb = _mm512_set1_epi64((long long)(((uint64_t)sc_hi << 32) | sc_lo));
        const __m256i mnb = _mm256_set1_epi64x((long long)(((uint64_t)mn_hi << 32) | mn_lo));
        const __m256i mins = _mm256_shuffle_epi8(
            mnb, _mm256_setr_epi8(0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3,
                                  -128, 4, -128, 4, -128, 5, -128, 5, -128, 6, -128, 6, -128, 7,
                                  -128, 7, -128));
        /* chunk k: [low nibbles | high nibbles] of its 32 bytes against 64 contiguous
         * activations, scales 2k (low half) and 2k+1 (high half) */
        __m512i s[MAX_ROWS_TILE];
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * k));
            const __m512i w = _mm512_and_si512(
                _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), lowmask);
            const __m512i idx = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set1_epi16((short)(0x8000 | (2 * k)))),
                _mm256_set1_epi16((short)(0x8000 | (2 * k + 1))), 1);
            const __m512i scv = _mm512_shuffle_epi8(scb, idx);
            for (int r = 0; r < R; r++) {
                const xq256 *xb = xbase + r * nb + b;
                const __m512i x = _mm512_loadu_si512((const void *)(xb->q + 64 * k));
                s[r] = T512_FN(madd_acc)(s[r], _mm512_maddubs_epi16(w, x), scv);
                PIN512(s[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            const xq256 *xb = xbase + r * nb + b;
            const __m256i si = T512_FN(fold)(s[r]);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)xb->bsums);
            const __m256i mm = _mm256_madd_epi16(bs, mins);
            const __m256 f = _mm256_set1_ps(d * xb->d), fm = _mm256_set1_ps(dmin * xb->d);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(f, _mm256_cvtepi32_ps(si)));
            accm[r] = _mm256_add_ps(accm[r], _mm256_mul_ps(fm, _mm256_cvtepi32_ps(mm)));
        }
    }
    for (int r = 0; r < R; r++)
        jb->y[(r0 + r) * jb->ldy + p->col0 + c] = hsum8_avx(acc[r]) - hsum8_avx(accm[r]);
}

T512_ATTR __attribute__((always_inline)) static inline void
T512_FN(q6k_tile)(const job_t *jb, const part_t *p, int64_t r0, int R, int64_t c) {
    const int64_t nb = jb->K / 256;
    const uint8_t *row = p->w + c * p->row_bytes;
    const __m512i m4 = _mm512_set1_epi8(0xF), m2 = _mm512_set1_epi8(3);
    __m256 acc[MAX_ROWS_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const xq256 *xbase = jb->x256 + r0 * nb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = h2f_f16c(rd16(blk + 208));
        __m512i s[MAX_ROWS_TILE];
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            /* chunks 4h+2j and 4h+2j+1 (j = 0, 1) side by side: their 64 activations are
             * contiguous. Low bits: [ql | ql + 32], shifted by 4 for j = 1; high bits:
             * [qh | qh >> 2], shifted by 4j. */
            const __m512i L = _mm512_loadu_si512((const void *)(blk + 64 * h));
            const __m256i hh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const __m512i H =
                _mm512_inserti64x4(_mm512_castsi256_si512(hh), _mm256_srli_epi16(hh, 2), 1);
            /* scales 8h .. 8h+7 as int16 in every 128-bit lane; lane i takes 4j+i */
            const __m512i all = _mm512_broadcast_i32x4(
                _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8 * h))));
            for (int j = 0; j < 2; j++) {
                const __m512i low = _mm512_and_si512(j ? _mm512_srli_epi16(L, 4) : L, m4);
                const __m512i high =
                    _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(H, 4 * j), m2), 4);
                const __m512i q = _mm512_or_si512(low, high);
                const __m512i scv = _mm512_shuffle_epi8(
                    all, T512_FN(pick16)(4 * j, 4 * j + 1, 4 * j + 2, 4 * j + 3));
                for (int r = 0; r < R; r++) {
                    const xq256 *xb = xbase + r * nb + b;
                    const __m512i x = _mm512_loadu_si512((const void *)(xb->q + 128 * h + 64 * j));
                    s[r] = T512_FN(madd_acc)(s[r], _mm512_maddubs_epi16(q, x), scv);
                    PIN512(s[r]);
                }
            }
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        for (int r = 0; r < R; r++) {
            const xq256 *xb = xbase + r * nb + b;
            const __m256i si = T512_FN(fold)(s[r]);
            const __m256i bs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), sc16);
            const __m256i st = _mm256_sub_epi32(si, _mm256_slli_epi32(bs, 5));
            const __m256 f = _mm256_set1_ps(d * xb->d);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(f, _mm256_cvtepi32_ps(st)));
        }
    }
    for (int r = 0; r < R; r++) jb->y[(r0 + r) * jb->ldy + p->col0 + c] = hsum8_avx(acc[r]);
}

/* Constant-R specializations and the tile table cols_run takes. */
#define T512_SPEC(name)                                                                         \
    T512_ATTR static void T512_FN(name##_r1)(const job_t *j, const part_t *p, int64_t r0,       \
                                             int64_t c) {                                       \
        T512_FN(name##_tile)(j, p, r0, 1, c);                                                   \
    }                                                                                           \
    T512_ATTR static void T512_FN(name##_r2)(const job_t *j, const part_t *p, int64_t r0,       \
                                             int64_t c) {                                       \
        T512_FN(name##_tile)(j, p, r0, 2, c);                                                   \
    }                                                                                           \
    T512_ATTR static void T512_FN(name##_r3)(const job_t *j, const part_t *p, int64_t r0,       \
                                             int64_t c) {                                       \
        T512_FN(name##_tile)(j, p, r0, 3, c);                                                   \
    }                                                                                           \
    T512_ATTR static void T512_FN(name##_r4)(const job_t *j, const part_t *p, int64_t r0,       \
                                             int64_t c) {                                       \
        T512_FN(name##_tile)(j, p, r0, 4, c);                                                   \
    }
T512_SPEC(legacy)
T512_SPEC(q4k)
T512_SPEC(q6k)
#undef T512_SPEC

static const tile_set T512_FN(tiles) = {
    {T512_FN(legacy_r1), T512_FN(legacy_r2), T512_FN(legacy_r3), T512_FN(legacy_r4)},
    {T512_FN(q4k_r1), T512_FN(q4k_r2), T512_FN(q4k_r3), T512_FN(q4k_r4)},
    {T512_FN(q6k_r1), T512_FN(q6k_r2), T512_FN(q6k_r3), T512_FN(q6k_r4)},
};

#undef PIN512
