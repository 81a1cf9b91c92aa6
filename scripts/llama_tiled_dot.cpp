// skiff: K-quant dot products in the tiled kernel's numerics (see skiff's scripts/llama_patch.py).
//
// Why: the tiled K-quant matmul (tiled-kernel.cpp) is ~1.5x faster than vec_dot for prompt-sized
// batches, but it takes only batches of 8+ rows and rounds differently from vec_dot, so a row's
// logits would depend on the batch around it. These dots compute one (weight row, activation row)
// pair exactly as the tiled kernel computes that element: per 256-element block the integer sums
// s1 = sum_s scale_s * (codes . q8)_s and s2 = sum_s min_s * bsum_s (exact in int32, so how they are
// summed does not matter), then the same float steps in the same order,
//     res = d0 * float(s1);  res = -(dmin0 * float(s2)) + res  (fused);  acc = res * d1 + acc  (fused),
// blocks in order from acc = 0. With GGML_CPU_TILED_DOT=1 a batch below 8 rows takes these and a
// batch of 8+ takes the tiled kernel: every row is computed the same way at any batch size.
// Only where the tiled kernel folds with FMA (AVX2 + FMA, and the AVX-512 VNNI kernel, whose
// mul-then-add GCC contracts); elsewhere ggml_tiled_vec_dot returns NULL and the switch turns the
// tiled matmul off instead (vec_dot for every row, as before).

static bool ggml_cpu_tiled_dot(void) {
    static int cached = -1;
    return ggml_cpu_skiff_flag("GGML_CPU_TILED_DOT", &cached, 0);
}

#if defined(__AVX2__) && defined(__FMA__)

static inline int32_t skiff_hsum_i32x8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static inline int32_t skiff_hsum_i32x4(__m128i s) {
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static inline __m128 skiff_cvt(int32_t v) {
    return _mm_cvtsi32_ss(_mm_setzero_ps(), v);
}

static void skiff_vec_dot_q4_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                               size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    GGML_ASSERT(nrc == 1);
    UNUSED(bs);
    UNUSED(bx);
    UNUSED(by);
    static const uint32_t kmask1 = 0x3f3f3f3f;
    static const uint32_t kmask2 = 0x0f0f0f0f;
    static const uint32_t kmask3 = 0x03030303;

    const block_q4_K * GGML_RESTRICT x = (const block_q4_K *) vx;
    const block_q8_K * GGML_RESTRICT y = (const block_q8_K *) vy;
    const int nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0xF);

    __m128 acc = _mm_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        uint32_t utmp[4];
        memcpy(utmp, x[i].scales, 12);
        utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
        const uint32_t uaux = utmp[1] & kmask1;
        utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
        utmp[2] = uaux;
        utmp[0] &= kmask1;
        const uint8_t * sc = (const uint8_t *) &utmp[0];

        const uint8_t * GGML_RESTRICT q4 = x[i].qs;
        const int8_t * GGML_RESTRICT q8 = y[i].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 64; ++j) {
            // 32 bytes: low nibbles are subblock 2j, high nibbles subblock 2j+1
            const __m256i bits = _mm256_loadu_si256((const __m256i *) (q4 + 32 * j));
            const __m256i lo = _mm256_and_si256(bits, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *) (q8 + 64 * j)));
            const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *) (q8 + 64 * j + 32)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_set1_epi16(sc[2 * j]), plo));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_set1_epi16(sc[2 * j + 1]), phi));
        }
        // s2 = sum_s min_s * (bsums[2s] + bsums[2s+1])
        const __m256i bsums = _mm256_loadu_si256((const __m256i *) y[i].bsums);
        const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) &utmp[2]));
        const int32_t s1 = skiff_hsum_i32x8(sumi);
        const int32_t s2 = skiff_hsum_i32x4(_mm_madd_epi16(mins, pairs));

        __m128 res = _mm_mul_ss(_mm_set_ss(ggml_fp16_to_fp32(x[i].data.data.d)), skiff_cvt(s1));
        res = _mm_fnmadd_ss(_mm_set_ss(ggml_fp16_to_fp32(x[i].data.data.dmin)), skiff_cvt(s2), res);
        acc = _mm_fmadd_ss(res, _mm_set_ss(y[i].d), acc);
    }
    *s = _mm_cvtss_f32(acc);
}

static void skiff_vec_dot_q6_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                               size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    GGML_ASSERT(nrc == 1);
    UNUSED(bs);
    UNUSED(bx);
    UNUSED(by);
    const block_q6_K * GGML_RESTRICT x = (const block_q6_K *) vx;
    const block_q8_K * GGML_RESTRICT y = (const block_q8_K *) vy;
    const int nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i m3 = _mm256_set1_epi8(3);

    __m128 acc = _mm_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const uint8_t * GGML_RESTRICT ql = x[i].ql;
        const uint8_t * GGML_RESTRICT qh = x[i].qh;
        const int8_t * GGML_RESTRICT q8 = y[i].qs;
        const int8_t * GGML_RESTRICT sc = x[i].scales;
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h) {
            // 128 elements: the unsigned 6-bit codes (4 low bits from ql, 2 high from qh)
            const __m256i l0 = _mm256_loadu_si256((const __m256i *) (ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *) (ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *) (qh + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
            for (int k = 0; k < 4; ++k) {
                // 32 elements = subblocks 8h+2k (low 128 bits of the products) and 8h+2k+1 (high)
                const int sb = 8 * h + 2 * k;
                const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *) (q8 + 128 * h + 32 * k)));
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[sb + 1]), _mm_set1_epi16(sc[sb]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scv, p));
            }
        }
        // the codes are stored +32: s1 = raw - 32 * sum_s scale_s * bsum_s
        const __m256i bsums = _mm256_loadu_si256((const __m256i *) y[i].bsums);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) sc));
        const int32_t corr = skiff_hsum_i32x8(_mm256_madd_epi16(sc16, bsums));
        const int32_t s1 = skiff_hsum_i32x8(sumi) - 32 * corr;

        const __m128 res = _mm_mul_ss(_mm_set_ss(ggml_fp16_to_fp32(x[i].d)), skiff_cvt(s1));
        acc = _mm_fmadd_ss(res, _mm_set_ss(y[i].d), acc);
    }
    *s = _mm_cvtss_f32(acc);
}

#endif // __AVX2__ && __FMA__

extern "C" ggml_vec_dot_t ggml_tiled_vec_dot(enum ggml_type type) {
    if (!ggml_cpu_tiled_dot()) {
        return NULL;
    }
#if defined(__AVX2__) && defined(__FMA__)
    switch (type) {
        case GGML_TYPE_Q4_K: return skiff_vec_dot_q4_K;
        case GGML_TYPE_Q6_K: return skiff_vec_dot_q6_K;
        default: return NULL;
    }
#else
    UNUSED(type);
    return NULL;
#endif
}

