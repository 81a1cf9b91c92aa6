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

// fp16 -> fp32 is exact, so any conversion gives the tiled kernel's bits; F16C's is inline
// (ggml_fp16_to_fp32 is a call into ggml-base per block)
static inline float skiff_f16(ggml_fp16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return ggml_fp16_to_fp32(h);
#endif
}

// four blocks' s1 partials (8 lanes each) -> their four sums, in block order
static inline __m128i skiff_hsum4_i32x8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

// four blocks' res (lane k = block k) folded into acc (lane 0) in block order: acc = res*d1 + acc
static inline __m128 skiff_fold4(__m128 acc, __m128 res, __m128 d1) {
    acc = _mm_fmadd_ss(res, d1, acc);
    acc = _mm_fmadd_ss(_mm_shuffle_ps(res, res, 1), _mm_shuffle_ps(d1, d1, 1), acc);
    acc = _mm_fmadd_ss(_mm_shuffle_ps(res, res, 2), _mm_shuffle_ps(d1, d1, 2), acc);
    return _mm_fmadd_ss(_mm_shuffle_ps(res, res, 3), _mm_shuffle_ps(d1, d1, 3), acc);
}

// one Q4_K block's integer sums: s1 as 8 lanes, s2 as 4 lanes (each sums to the block's value)
static inline void skiff_q4_K_sums(const block_q4_K & x, const block_q8_K & y, __m256i & s1, __m128i & s2) {
    static const uint32_t kmask1 = 0x3f3f3f3f;
    static const uint32_t kmask2 = 0x0f0f0f0f;
    static const uint32_t kmask3 = 0x03030303;
    const __m256i m4 = _mm256_set1_epi8(0xF);

    uint32_t utmp[4];
    memcpy(utmp, x.scales, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
    const uint8_t * sc = (const uint8_t *) &utmp[0];

    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < QK_K / 64; ++j) {
        // 32 bytes: low nibbles are subblock 2j, high nibbles subblock 2j+1
        const __m256i bits = _mm256_loadu_si256((const __m256i *) (x.qs + 32 * j));
        const __m256i lo = _mm256_and_si256(bits, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *) (y.qs + 64 * j)));
        const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *) (y.qs + 64 * j + 32)));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_set1_epi16(sc[2 * j]), plo));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_set1_epi16(sc[2 * j + 1]), phi));
    }
    s1 = sumi;
    // s2 = sum_s min_s * (bsums[2s] + bsums[2s+1])
    const __m256i bsums = _mm256_loadu_si256((const __m256i *) y.bsums);
    const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
    s2 = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) &utmp[2])), pairs);
}

static void skiff_vec_dot_q4_K(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                               size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    GGML_ASSERT(nrc == 1);
    UNUSED(bs);
    UNUSED(bx);
    UNUSED(by);
    const block_q4_K * GGML_RESTRICT x = (const block_q4_K *) vx;
    const block_q8_K * GGML_RESTRICT y = (const block_q8_K *) vy;
    const int nb = n / QK_K;

    __m128 acc = _mm_setzero_ps();
    int i = 0;
    for (; i + 4 <= nb; i += 4) {  // four blocks' sums reduced together, folded one by one
        __m256i a[4];
        __m128i m[4];
        for (int k = 0; k < 4; ++k) {
            skiff_q4_K_sums(x[i + k], y[i + k], a[k], m[k]);
        }
        const __m128i s1 = skiff_hsum4_i32x8(a[0], a[1], a[2], a[3]);
        const __m128i s2 = _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(m[2], m[3]));
        const __m128 d0 = _mm_setr_ps(skiff_f16(x[i].data.data.d), skiff_f16(x[i + 1].data.data.d),
                                      skiff_f16(x[i + 2].data.data.d), skiff_f16(x[i + 3].data.data.d));
        const __m128 dmin = _mm_setr_ps(skiff_f16(x[i].data.data.dmin), skiff_f16(x[i + 1].data.data.dmin),
                                        skiff_f16(x[i + 2].data.data.dmin), skiff_f16(x[i + 3].data.data.dmin));
        __m128 res = _mm_mul_ps(d0, _mm_cvtepi32_ps(s1));
        res = _mm_fnmadd_ps(dmin, _mm_cvtepi32_ps(s2), res);
        acc = skiff_fold4(acc, res, _mm_setr_ps(y[i].d, y[i + 1].d, y[i + 2].d, y[i + 3].d));
    }
    for (; i < nb; ++i) {
        __m256i a;
        __m128i m;
        skiff_q4_K_sums(x[i], y[i], a, m);
        __m128 res = _mm_mul_ss(_mm_set_ss(skiff_f16(x[i].data.data.d)), skiff_cvt(skiff_hsum_i32x8(a)));
        res = _mm_fnmadd_ss(_mm_set_ss(skiff_f16(x[i].data.data.dmin)), skiff_cvt(skiff_hsum_i32x4(m)), res);
        acc = _mm_fmadd_ss(res, _mm_set_ss(y[i].d), acc);
    }
    *s = _mm_cvtss_f32(acc);
}

// one Q6_K block's integer sums as 8 lanes each: the unsigned codes' (raw) and
// sum_s scale_s * bsum_s (corr); the block's s1 is sum(raw) - 32 * sum(corr)
static inline void skiff_q6_K_sums(const block_q6_K & x, const block_q8_K & y, __m256i & raw, __m256i & corr) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i m3 = _mm256_set1_epi8(3);
    const int8_t * sc = x.scales;
    __m256i sumi = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
        // 128 elements: the unsigned 6-bit codes (4 low bits from ql, 2 high from qh)
        const __m256i l0 = _mm256_loadu_si256((const __m256i *) (x.ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *) (x.ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *) (x.qh + 32 * h));
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
            const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *) (y.qs + 128 * h + 32 * k)));
            const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[sb + 1]), _mm_set1_epi16(sc[sb]));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scv, p));
        }
    }
    raw = sumi;
    const __m256i bsums = _mm256_loadu_si256((const __m256i *) y.bsums);
    corr = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) sc)), bsums);
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

    __m128 acc = _mm_setzero_ps();
    int i = 0;
    for (; i + 4 <= nb; i += 4) {  // four blocks' sums reduced together, folded one by one
        __m256i r[4];
        __m256i c[4];
        for (int k = 0; k < 4; ++k) {
            skiff_q6_K_sums(x[i + k], y[i + k], r[k], c[k]);
        }
        const __m128i s1 = _mm_sub_epi32(skiff_hsum4_i32x8(r[0], r[1], r[2], r[3]),
                                         _mm_slli_epi32(skiff_hsum4_i32x8(c[0], c[1], c[2], c[3]), 5));
        const __m128 d0 = _mm_setr_ps(skiff_f16(x[i].d), skiff_f16(x[i + 1].d),
                                      skiff_f16(x[i + 2].d), skiff_f16(x[i + 3].d));
        const __m128 res = _mm_mul_ps(d0, _mm_cvtepi32_ps(s1));
        acc = skiff_fold4(acc, res, _mm_setr_ps(y[i].d, y[i + 1].d, y[i + 2].d, y[i + 3].d));
    }
    for (; i < nb; ++i) {
        __m256i r;
        __m256i c;
        skiff_q6_K_sums(x[i], y[i], r, c);
        const int32_t s1 = skiff_hsum_i32x8(r) - 32 * skiff_hsum_i32x8(c);
        const __m128 res = _mm_mul_ss(_mm_set_ss(skiff_f16(x[i].d)), skiff_cvt(s1));
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

