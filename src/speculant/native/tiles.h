/*
 * Matmul tiles over packed weights (see "repacked weights" in kernels.c). kernels.c
 * includes this file once per instruction set, with
 *   TL_ATTR      the target attribute,
 *   TL_FN(name)  the suffix of every function defined here,
 *   TL_VNNI      1 where vpdpbusd takes the 4-byte dot products, 0 for maddubs + madd,
 *   TL_COLS      the most columns a tile takes (2 where 32 vector registers exist),
 *   TL_ROWS      the most rows a one-column tile takes (8 where 32 registers exist),
 *   TL_PIN(v)    an empty asm that keeps an accumulator in its register;
 * it undefines them at its end.
 * A tile is R rows (1..TL_ROWS) by one column, or up to 4 rows by C columns
 * (1..TL_COLS). Each weight register is decoded once
 * and used for every row of the tile; each activation register once for every column.
 *
 * The results are bitwise those of cols_portable: the integer lane sums are exact (the
 * same numbers whether vpdpbusd or maddubs + madd forms them; maddubs cannot saturate
 * with codes below 64, and Q8_0 takes the sign trick on signed codes there), and every
 * float operation is the portable code's, in its order, per (row, column): the same
 * multiplies and fused multiply-adds.
 */

/* acc + the int32 sums of 4 products of unsigned codes w and signed activations x */
TL_ATTR static inline __m256i TL_FN(dot)(__m256i acc, __m256i w, __m256i x) {
#if TL_VNNI
    return _mm256_dpbusd_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

#if !TL_VNNI
/* acc + the int32 sums of 4 products of signed codes w and signed activations x */
TL_ATTR static inline __m256i TL_FN(sdot)(__m256i acc, __m256i w, __m256i x) {
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

TL_ATTR static inline __m256i TL_FN(load)(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* Q6_K's high bits: bits 2ch, 2ch + 1 of each byte of h moved to bits 4, 5 (the rest 0)
 * by one shift of the 16-bit lanes (none for ch = 2): a byte's bits 4, 5 then come from
 * its own bits, never from its neighbour's */
TL_ATTR static inline __m256i TL_FN(q6_high)(__m256i h, const int ch, __m256i m30) {
    const __m256i s = ch == 0   ? _mm256_slli_epi16(h, 4)
                      : ch == 1 ? _mm256_slli_epi16(h, 2)
                      : ch == 2 ? h
                                : _mm256_srli_epi16(h, 2);
    return _mm256_and_si256(s, m30);
}

/* ----------------------------------------------------------------------- K-quants */
TL_ATTR __attribute__((always_inline)) static inline void
TL_FN(kq_tile)(const job_t *jb, const part_t *p, int64_t r0, const int R, int64_t c, const int C,
               const int q6, const int64_t u0, const int64_t u1, float *carry) {
    const int64_t nu = jb->nk;
    const int64_t ub = p->unit_bytes;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    const uint8_t *wrow[TL_COLS];
    for (int cc = 0; cc < C; cc++) wrow[cc] = p->w + (c + cc) * p->row_bytes;
    const xk_t *xrow[MAX_ROWS_TILE];
    for (int r = 0; r < R; r++) xrow[r] = jb->xk + (r0 + r) * nu;
    __m256 acc[MAX_ROWS_TILE][TL_COLS];
    /* blocks [u0, u1) (a span, with carry: spans_run); a span after a column's first
     * takes its sums from carry ([R][C][8]), one before its last leaves them there */
    for (int r = 0; r < R; r++)
        for (int cc = 0; cc < C; cc++)
            acc[r][cc] = u0 ? _mm256_loadu_ps(carry + 8 * (r * C + cc)) : _mm256_setzero_ps();
    const int64_t pfd = !carry && R >= g_prefetch_rows ? g_prefetch_bytes : 0;
    const int64_t pf2 = prefetch_l2_for(jb, pfd);
    for (int64_t u = u0; u < u1; u++) {
        const uint8_t *blk[TL_COLS];
        for (int cc = 0; cc < C; cc++) {
            blk[cc] = wrow[cc] + u * ub;
            if (pfd) PREFETCH_UNIT(blk[cc], ub, pfd, pf2);
        }
        /* Q6_K: A sums registers 0-3, B registers 4-7; Q4_K: A sums all 8 (or A and B
         * split as Q6_K's, added before the scale, in tiles of up to 2 rows) */
        __m256i A[MAX_ROWS_TILE][TL_COLS], B[MAX_ROWS_TILE][TL_COLS];
        for (int r = 0; r < R; r++)
            for (int cc = 0; cc < C; cc++) {
                A[r][cc] = _mm256_setzero_si256();
                if (q6 || R <= 2) B[r][cc] = _mm256_setzero_si256();
            }
        for (int ch = 0; ch < 4; ch++) {
            __m256i lo[TL_COLS], hi[TL_COLS];
            for (int cc = 0; cc < C; cc++) {
                const __m256i q = TL_FN(load)(blk[cc] + (q6 ? 0 : 16) + 32 * ch);
                lo[cc] = _mm256_and_si256(q, m4);
                hi[cc] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                if (q6) {
                    const __m256i h0 = TL_FN(load)(blk[cc] + 128), h1 = TL_FN(load)(blk[cc] + 160);
                    lo[cc] = _mm256_or_si256(lo[cc], TL_FN(q6_high)(h0, ch, m30));
                    hi[cc] = _mm256_or_si256(hi[cc], TL_FN(q6_high)(h1, ch, m30));
                }
            }
            for (int r = 0; r < R; r++) {
                const int8_t *xq = q6 ? xrow[r][u].q16 : xrow[r][u].q32;
                const __m256i xa = TL_FN(load)(xq + 32 * ch);
                const __m256i xb = TL_FN(load)(xq + 32 * (ch + 4));
                for (int cc = 0; cc < C; cc++) {
                    /* Q4_K's lanes are the same sub-blocks in every register: one sum */
                    A[r][cc] = TL_FN(dot)(A[r][cc], lo[cc], xa);
                    if (q6 || R <= 2) { /* R <= 2: two sums, for shorter dependency chains */
                        B[r][cc] = TL_FN(dot)(B[r][cc], hi[cc], xb);
                        TL_PIN(B[r][cc]);
                    } else {
                        A[r][cc] = TL_FN(dot)(A[r][cc], hi[cc], xb);
                    }
                    TL_PIN(A[r][cc]);
                }
            }
        }
        for (int cc = 0; cc < C; cc++) {
            const uint8_t *bk = blk[cc];
            if (q6) {
                const __m128i s8 = _mm_loadu_si128((const __m128i *)(bk + 192));
                const __m256i scA = _mm256_cvtepi8_epi32(s8);
                const __m256i scB = _mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8));
                const __m256i sc16 = _mm256_cvtepi8_epi16(s8);
                const __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(bk + 208)));
                for (int r = 0; r < R; r++) {
                    const xk_t *xb = xrow[r] + u;
                    const __m256i bs = _mm256_madd_epi16(TL_FN(load)(xb->bsums), sc16);
                    __m256i s = _mm256_add_epi32(_mm256_mullo_epi32(A[r][cc], scA),
                                                 _mm256_mullo_epi32(B[r][cc], scB));
                    s = _mm256_sub_epi32(s, _mm256_slli_epi32(bs, 5));
                    acc[r][cc] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), d),
                                                 _mm256_broadcast_ss(&xb->d), acc[r][cc]);
                }
            } else {
                const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16((short)rd16(bk)));
                const __m256 dmin = _mm256_cvtph_ps(_mm_set1_epi16((short)rd16(bk + 2)));
                uint64_t sc8, mn8;
                q4k_scales8(bk + 4, &sc8, &mn8);
                const __m256i sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8));
                const __m256i mn = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8));
                /* exact products, formed once for the tile's rows (see cols_portable) */
                const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                const __m256 dmn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn));
                for (int r = 0; r < R; r++) {
                    const xk_t *xb = xrow[r] + u;
                    __m256i a = A[r][cc];
                    if (R <= 2) a = _mm256_add_epi32(a, B[r][cc]);
                    /* -(bs32 mn dmin) + a sc d: one rounding, as the portable fmaf */
                    const __m256 v = _mm256_fnmadd_ps(_mm256_loadu_ps(xb->bs32f), dmn,
                                                      _mm256_mul_ps(_mm256_cvtepi32_ps(a), dsc));
                    acc[r][cc] = _mm256_fmadd_ps(v, _mm256_broadcast_ss(&xb->d), acc[r][cc]);
                }
            }
        }
    }
    if (u1 < nu) {
        for (int r = 0; r < R; r++)
            for (int cc = 0; cc < C; cc++) _mm256_storeu_ps(carry + 8 * (r * C + cc), acc[r][cc]);
        return;
    }
    for (int r = 0; r < R; r++)
        for (int cc = 0; cc < C; cc++) jb->y[(r0 + r) * jb->ldy + p->col0 + c + cc] = hsum8_avx(acc[r][cc]);
}

/* ---------------------------------------------------------------- legacy formats */
TL_ATTR __attribute__((always_inline)) static inline void
TL_FN(lg_tile)(const job_t *jb, const part_t *p, int64_t r0, const int R, int64_t c, const int C,
               const int type) {
    const int64_t nu = jb->ng;
    const int64_t ub = p->unit_bytes;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const int codes_at = legacy_codes_at(type);
    /* the code offsets are powers of two (or 0); without VNNI Q8_0 takes signed codes,
     * whose sums need no offset */
    const int offset = !TL_VNNI && type == T_Q8_0 ? 0 : legacy_offset(type);
    const int off_shift = offset ? __builtin_ctz((unsigned)offset) : 0;
    const uint8_t *wrow[TL_COLS];
    for (int cc = 0; cc < C; cc++) wrow[cc] = p->w + (c + cc) * p->row_bytes;
    const xg_t *xrow[MAX_ROWS_TILE];
    for (int r = 0; r < R; r++) xrow[r] = jb->xg + (r0 + r) * nu;
    __m256 acc[MAX_ROWS_TILE][TL_COLS];
    for (int r = 0; r < R; r++)
        for (int cc = 0; cc < C; cc++) acc[r][cc] = _mm256_setzero_ps();
    const int64_t pfd = R >= g_prefetch_rows ? g_prefetch_bytes : 0;
    const int64_t pf2 = prefetch_l2_for(jb, pfd);
    for (int64_t u = 0; u < nu; u++) {
        const uint8_t *g[TL_COLS];
        for (int cc = 0; cc < C; cc++) {
            g[cc] = wrow[cc] + u * ub;
            if (pfd) PREFETCH_UNIT(g[cc], ub, pfd, pf2);
        }
        /* lane l: block l in every register, so one sum */
        __m256i A[MAX_ROWS_TILE][TL_COLS];
        for (int r = 0; r < R; r++)
            for (int cc = 0; cc < C; cc++) A[r][cc] = _mm256_setzero_si256();
        for (int ch = 0; ch < 4; ch++) {
            __m256i lo[TL_COLS], hi[TL_COLS];
            for (int cc = 0; cc < C; cc++) {
                if (type == T_Q8_0) {
                    lo[cc] = TL_FN(load)(g[cc] + codes_at + 32 * ch);
                    hi[cc] = TL_FN(load)(g[cc] + codes_at + 32 * (ch + 4));
#if !TL_VNNI
                    const __m256i flip = _mm256_set1_epi8((char)0x80);
                    lo[cc] = _mm256_xor_si256(lo[cc], flip);
                    hi[cc] = _mm256_xor_si256(hi[cc], flip);
#endif
                } else {
                    const __m256i q = TL_FN(load)(g[cc] + codes_at + 32 * ch);
                    lo[cc] = _mm256_and_si256(q, m4);
                    hi[cc] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    if (type == T_Q5_0) {
                        /* bit t of each byte -> bit 4 of register t (t = ch, ch + 4) */
                        const __m256i qh = TL_FN(load)(g[cc] + 16);
                        const __m256i bl = _mm256_and_si256(qh, _mm256_set1_epi8((char)(1 << ch)));
                        const __m256i bh = _mm256_and_si256(qh, _mm256_set1_epi8((char)(16 << ch)));
                        lo[cc] = _mm256_or_si256(lo[cc], _mm256_slli_epi16(bl, 4 - ch));
                        hi[cc] = _mm256_or_si256(hi[cc], _mm256_srli_epi16(bh, ch));
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256i xa = TL_FN(load)(xrow[r][u].q + 32 * ch);
                const __m256i xb = TL_FN(load)(xrow[r][u].q + 32 * (ch + 4));
                for (int cc = 0; cc < C; cc++) {
#if !TL_VNNI
                    if (type == T_Q8_0) {
                        A[r][cc] = TL_FN(sdot)(A[r][cc], lo[cc], xa);
                        A[r][cc] = TL_FN(sdot)(A[r][cc], hi[cc], xb);
                    } else
#endif
                    {
                        A[r][cc] = TL_FN(dot)(A[r][cc], lo[cc], xa);
                        A[r][cc] = TL_FN(dot)(A[r][cc], hi[cc], xb);
                    }
                    TL_PIN(A[r][cc]);
                }
            }
        }
        for (int cc = 0; cc < C; cc++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g[cc]));
            const __m256 mw = type == T_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g[cc] + 16)))
                                             : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const xg_t *xb = xrow[r] + u;
                __m256i s = A[r][cc];
                if (off_shift)
                    s = _mm256_sub_epi32(s, _mm256_slli_epi32(TL_FN(load)(xb->bs), off_shift));
                const __m256 f = _mm256_mul_ps(dw, _mm256_loadu_ps(xb->d));
                acc[r][cc] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), f, acc[r][cc]);
                if (type == T_Q4_1)
                    acc[r][cc] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xb->s), acc[r][cc]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int cc = 0; cc < C; cc++) jb->y[(r0 + r) * jb->ldy + p->col0 + c + cc] = hsum8_avx(acc[r][cc]);
}

/* Specializations: every (format, R, C) a function of its own, so that the loops unroll
 * and the accumulators live in registers. */
#define TL_ONE(kind, call, R, C)                                                               \
    TL_ATTR static void TL_FN(kind##_##R##_##C)(const job_t *j, const part_t *p, int64_t r0,    \
                                                 int64_t c) {                                   \
        call(j, p, r0, R, c, C);                                                                \
    }
#define TL_KIND(kind, call)                                                                     \
    TL_ONE(kind, call, 1, 1)                                                                    \
    TL_ONE(kind, call, 2, 1)                                                                    \
    TL_ONE(kind, call, 3, 1)                                                                    \
    TL_ONE(kind, call, 4, 1)                                                                    \
    TL_ONE(kind, call, 5, 1)                                                                    \
    TL_ONE(kind, call, 6, 1)                                                                    \
    TL_ONE(kind, call, 7, 1)                                                                    \
    TL_ONE(kind, call, 8, 1)                                                                    \
    TL_ONE(kind, call, 1, 2)                                                                    \
    TL_ONE(kind, call, 2, 2)                                                                    \
    TL_ONE(kind, call, 3, 2)                                                                    \
    TL_ONE(kind, call, 4, 2)
/* two-column tiles take at most 4 rows */
#define TL_ROW(kind)                                                                            \
    {{TL_FN(kind##_1_1), TL_FN(kind##_1_2)},                                                    \
     {TL_FN(kind##_2_1), TL_FN(kind##_2_2)},                                                    \
     {TL_FN(kind##_3_1), TL_FN(kind##_3_2)},                                                    \
     {TL_FN(kind##_4_1), TL_FN(kind##_4_2)},                                                    \
     {TL_FN(kind##_5_1), TL_FN(kind##_5_1)},                                                    \
     {TL_FN(kind##_6_1), TL_FN(kind##_6_1)},                                                    \
     {TL_FN(kind##_7_1), TL_FN(kind##_7_1)},                                                    \
     {TL_FN(kind##_8_1), TL_FN(kind##_8_1)}}

#define TL_Q40(j, p, r0, R, c, C) TL_FN(lg_tile)(j, p, r0, R, c, (C) < TL_COLS ? (C) : TL_COLS, T_Q4_0)
#define TL_Q41(j, p, r0, R, c, C) TL_FN(lg_tile)(j, p, r0, R, c, (C) < TL_COLS ? (C) : TL_COLS, T_Q4_1)
#define TL_Q50(j, p, r0, R, c, C) TL_FN(lg_tile)(j, p, r0, R, c, (C) < TL_COLS ? (C) : TL_COLS, T_Q5_0)
#define TL_Q80(j, p, r0, R, c, C) TL_FN(lg_tile)(j, p, r0, R, c, (C) < TL_COLS ? (C) : TL_COLS, T_Q8_0)
#define TL_Q4K(j, p, r0, R, c, C)                                                               \
    TL_FN(kq_tile)(j, p, r0, R, c, (C) < TL_COLS ? (C) : TL_COLS, 0, 0, (j)->nk, NULL)
#define TL_Q6K(j, p, r0, R, c, C)                                                               \
    TL_FN(kq_tile)(j, p, r0, R, c, (C) < TL_COLS ? (C) : TL_COLS, 1, 0, (j)->nk, NULL)
TL_KIND(q40, TL_Q40)
TL_KIND(q41, TL_Q41)
TL_KIND(q50, TL_Q50)
TL_KIND(q80, TL_Q80)
TL_KIND(q4k, TL_Q4K)
TL_KIND(q6k, TL_Q6K)

/* one-column K-quant tiles over a span of blocks (spans_run) */
#define TL_SPAN(kind, q6, R)                                                                    \
    TL_ATTR static void TL_FN(span_##kind##_##R)(const job_t *j, const part_t *p, int64_t r0,   \
                                                  int64_t c, int64_t u0, int64_t u1, float *cy) { \
        TL_FN(kq_tile)(j, p, r0, R, c, 1, q6, u0, u1, cy);                                      \
    }
#define TL_SPANS(kind, q6)                                                                      \
    TL_SPAN(kind, q6, 1) TL_SPAN(kind, q6, 2) TL_SPAN(kind, q6, 3) TL_SPAN(kind, q6, 4)         \
    TL_SPAN(kind, q6, 5) TL_SPAN(kind, q6, 6) TL_SPAN(kind, q6, 7) TL_SPAN(kind, q6, 8)
TL_SPANS(q4k, 0)
TL_SPANS(q6k, 1)
/* tiles of up to 2 columns over a span (rows_outer_run) */
#define TL_SPAN2(kind, q6, R)                                                                   \
    TL_ATTR static void TL_FN(span2_##kind##_##R)(const job_t *j, const part_t *p, int64_t r0,  \
                                                   int64_t c, int64_t u0, int64_t u1, float *cy) { \
        TL_FN(kq_tile)(j, p, r0, R, c, TL_COLS < 2 ? TL_COLS : 2, q6, u0, u1, cy);              \
    }
TL_SPAN2(q4k, 0, 1) TL_SPAN2(q4k, 0, 2) TL_SPAN2(q4k, 0, 3) TL_SPAN2(q4k, 0, 4)
TL_SPAN2(q6k, 1, 1) TL_SPAN2(q6k, 1, 2) TL_SPAN2(q6k, 1, 3) TL_SPAN2(q6k, 1, 4)
#define TL_SPAN_ROW(kind)                                                                       \
    {TL_FN(span_##kind##_1), TL_FN(span_##kind##_2), TL_FN(span_##kind##_3),                    \
     TL_FN(span_##kind##_4), TL_FN(span_##kind##_5), TL_FN(span_##kind##_6),                    \
     TL_FN(span_##kind##_7), TL_FN(span_##kind##_8)}

static const tile_set TL_FN(tiles) = {
    TL_COLS,
    TL_ROWS,
    {TL_ROW(q40), TL_ROW(q41), TL_ROW(q50), TL_ROW(q80), TL_ROW(q4k), TL_ROW(q6k)},
    {TL_SPAN_ROW(q4k), TL_SPAN_ROW(q6k)},
    {{TL_FN(span2_q4k_1), TL_FN(span2_q4k_2), TL_FN(span2_q4k_3), TL_FN(span2_q4k_4)},
     {TL_FN(span2_q6k_1), TL_FN(span2_q6k_2), TL_FN(span2_q6k_3), TL_FN(span2_q6k_4)}},
};
#undef TL_SPAN
#undef TL_SPANS
#undef TL_SPAN_ROW
#undef TL_SPAN2

#undef TL_ONE
#undef TL_KIND
#undef TL_ROW
#undef TL_Q40
#undef TL_Q41
#undef TL_Q50
#undef TL_Q80
#undef TL_Q4K
#undef TL_Q6K
#undef TL_ATTR
#undef TL_FN
#undef TL_VNNI
#undef TL_COLS
#undef TL_ROWS
#undef TL_PIN
