// skiff: GGML_CPU_Q8_GEMM=1: tinyBLAS's Q8_0 / Q5_0 x Q8_0 matmul, twice as wide and streamed
// ahead (see skiff's scripts/llama_patch.py). Inserted into llamafile/sgemm.cpp before
// llamafile_sgemm.
//
// Why: a decode step multiplies a few rows by every weight. Gemma 3 270M's head is Q8_0
// (262,144 x 640, 178 MB) and its attention and FFN inputs Q5_0; tinyBLAS_Q0_AVX (2+ rows)
// computes one dot per 256-bit register and pays a sign trick per dot, and ggml's vec_dot
// (one row) waits on memory. This kernel computes two dots per 512-bit register (a weight
// block against two columns), folds the sign trick into a per-column bias, and prefetches the
// next tile's weights while it computes this one.
//
// Its numbers are tinyBLAS's and vec_dot's, bit for bit (both compute an element this way on
// x86), which is what keeps a row's logits independent of the batch: per block l,
//   lanes_i  = sum of a*b over the block's quants 4i..4i+3 (exact integers; tinyBLAS:
//              dpbusd(|a|, b*sign(a)); here dpbusd(a + 128, b) - 128 * sum(b): the same ints)
//   acc_i    = fma(fp32(d_a) * fp32(d_b), float(lanes_i), acc_i)   (8 lanes, block order)
// then tinyBLAS's horizontal sum of the 8 lanes, in its order. So it may take any subset of
// shapes; it takes them all: a decode step's few columns (one to 32, one block) and a
// prompt's hundreds alike, in blocks of GGML_Q8_GEMM_SPAN columns (prefill ~1.25x tinyBLAS).
#include <atomic>
#include <vector>

static std::atomic<int64_t> ggml_q8_gemm_taken{0};

// How many matmuls the kernel has taken in this process (tests: the switch is live).
extern "C" int64_t ggml_cpu_q8_gemm_calls(void) {
    return ggml_q8_gemm_taken.load();
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
static inline bool ggml_cpu_q8_gemm(void) {
    static int cached = -1;
    return ggml_cpu_skiff_flag("GGML_CPU_Q8_GEMM", &cached, 0);
}

// Columns a block: prepared once, run against every weight row of a thread's share. 32 was
// measured beside 16, 24 and 64 (16-32 within 2% at prefill, 64 ~4% slower; a decode step is
// one block). Each thread prepares the block for itself: n x k work against its m/nth x n x k.
#define GGML_Q8_GEMM_SPAN 32

namespace {

// tinyBLAS's hsum(__m256): high half + low half, then (0+2) + (1+3)
inline float q8g_hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Two columns' block l side by side: their quants, -128 x each 4-quant group's sum (the
// unsigned weights' offset taken back out), and each column's scale on its 8 lanes.
struct q8g_pair {
    __m512i b;
    __m512i bias;
    __m512 d;
};

inline q8g_pair q8g_prepare(const block_q8_0 * lo, const block_q8_0 * hi) {
    q8g_pair out;
    out.b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) lo->qs)),
                               _mm256_loadu_si256((const __m256i *) hi->qs), 1);
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), out.b);
    out.bias = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7));
    out.d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(lo->d)),
                                 _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(hi->d)));
    return out;
}

// A weight block's 32 quants as int8, as tinyBLAS's load() and vec_dot unpack them.
inline __m256i q8g_quants(const block_q8_0 * a) {
    return _mm256_loadu_si256((const __m256i *) a->qs);
}

// Q5_0: low nibbles are quants 0-15, high nibbles 16-31, bit j of qh quant j's fifth
// bit; the value is that 5-bit number minus 16 (a clear bit sets the high nibble to 0xF).
inline __m256i q8g_quants(const block_q5_0 * a) {
    const __m128i x = _mm_loadu_si128((const __m128i *) a->qs);
    const __m256i nibbles = _mm256_and_si256(
        _mm256_set1_epi8(15), _mm256_inserti128_si256(_mm256_castsi128_si256(x), _mm_srli_epi16(x, 4), 1));
    uint32_t qh;
    memcpy(&qh, a->qh, sizeof(qh));
    const __m256i fifth = _mm256_movm_epi8(qh);
    return _mm256_or_si256(nibbles, _mm256_andnot_si256(fifth, _mm256_set1_epi8((char) 0xF0)));
}

// RM weight rows from ii against P prepared pairs (columns 2p, 2p+1 of the group at j0);
// ``odd``: the last pair's second column is a copy, not stored.
template <typename TA, int RM, int P>
void q8g_tile(int64_t k, const TA * A, int64_t lda, const q8g_pair * cols,
              int64_t npairs, float * C, int64_t ldc, int64_t ii, int64_t j0, bool odd) {
    __m512 acc[RM][P];
    for (int r = 0; r < RM; ++r) {
        for (int p = 0; p < P; ++p) {
            acc[r][p] = _mm512_setzero_ps();
        }
    }
    const __m512i flip = _mm512_set1_epi8((char) 0x80);
    for (int64_t l = 0; l < k; ++l) {
        const q8g_pair * cl = cols + l * npairs;
        for (int r = 0; r < RM; ++r) {  // the next tile's same block: the stream stays ahead
            _mm_prefetch((const char *) (A + lda * (ii + RM + r) + l), _MM_HINT_T0);
        }
        for (int r = 0; r < RM; ++r) {
            const TA * a = A + lda * (ii + r) + l;
            const __m512i av = _mm512_xor_si512(_mm512_broadcast_i64x4(q8g_quants(a)), flip);
            const __m512 da = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(a->d));
            for (int p = 0; p < P; ++p) {
                const __m512i lanes = _mm512_dpbusd_epi32(cl[p].bias, av, cl[p].b);
                acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(da, cl[p].d),
                                            _mm512_cvtepi32_ps(lanes), acc[r][p]);
            }
        }
    }
    for (int r = 0; r < RM; ++r) {
        for (int p = 0; p < P; ++p) {
            const int64_t j = j0 + 2 * p;
            C[ldc * j + ii + r] = q8g_hsum8(_mm512_castps512_ps256(acc[r][p]));
            if (!(odd && p == P - 1)) {
                const __m512 high = _mm512_shuffle_f32x4(acc[r][p], acc[r][p], 0xEE);
                C[ldc * (j + 1) + ii + r] = q8g_hsum8(_mm512_castps512_ps256(high));
            }
        }
    }
}

template <typename TA, int RM>
void q8g_rows(int64_t k, const TA * A, int64_t lda, const q8g_pair * cols,
              int64_t npairs, float * C, int64_t ldc, int64_t ii, int64_t n) {
    for (int64_t g = 0; g < npairs; g += 4) {
        const int64_t left = npairs - g;
        const bool odd = (n & 1) && left <= 4;
        const q8g_pair * c = cols + g;
        switch (left < 4 ? left : 4) {
            case 4: q8g_tile<TA, RM, 4>(k, A, lda, c, npairs, C, ldc, ii, 2 * g, odd); break;
            case 3: q8g_tile<TA, RM, 3>(k, A, lda, c, npairs, C, ldc, ii, 2 * g, odd); break;
            case 2: q8g_tile<TA, RM, 2>(k, A, lda, c, npairs, C, ldc, ii, 2 * g, odd); break;
            default: q8g_tile<TA, RM, 1>(k, A, lda, c, npairs, C, ldc, ii, 2 * g, odd); break;
        }
    }
}

}  // namespace

// C[ldc*j + i] = row i of A . column j of B, for thread ith of nth.
template <typename TA>
static void ggml_q8_gemm_rows(int64_t m, int64_t n, int64_t k, const TA * A, int64_t lda,
                              const block_q8_0 * B, int64_t ldb, float * C, int64_t ldc,
                              int ith, int nth) {
    if (ith == 0) {
        ggml_q8_gemm_taken.fetch_add(1, std::memory_order_relaxed);
    }
    // Columns go in blocks of GGML_Q8_GEMM_SPAN, each prepared once (k x 192 bytes a pair,
    // L2-resident) and run against every row of this thread's share.
    const int64_t span = n < GGML_Q8_GEMM_SPAN ? n : GGML_Q8_GEMM_SPAN;
    std::vector<q8g_pair> cols((size_t) (k * ((span + 1) / 2)));
    const int64_t tiles = m / 4;
    const int64_t duty = (tiles + nth - 1) / nth;
    const int64_t start = duty * ith;
    const int64_t end = start + duty < tiles ? start + duty : tiles;
    for (int64_t c0 = 0; c0 < n; c0 += span) {
        const int64_t nc = n - c0 < span ? n - c0 : span;
        const int64_t npairs = (nc + 1) / 2;
        const block_q8_0 * Bc = B + ldb * c0;
        for (int64_t l = 0; l < k; ++l) {
            for (int64_t p = 0; p < npairs; ++p) {
                const int64_t j = 2 * p;
                const int64_t j1 = j + 1 < nc ? j + 1 : j;
                cols[l * npairs + p] = q8g_prepare(Bc + ldb * j + l, Bc + ldb * j1 + l);
            }
        }
        float * Cc = C + ldc * c0;
        for (int64_t t = start; t < end; ++t) {
            q8g_rows<TA, 4>(k, A, lda, cols.data(), npairs, Cc, ldc, 4 * t, nc);
        }
        if (ith == nth - 1) {
            for (int64_t i = 4 * tiles; i < m; ++i) {
                q8g_rows<TA, 1>(k, A, lda, cols.data(), npairs, Cc, ldc, i, nc);
            }
        }
    }
}

// Q8_0 or Q5_0 weights (Atype) x Q8_0 rows; false: not taken (tinyBLAS / vec_dot then).
static bool ggml_q8_gemm(int64_t m, int64_t n, int64_t k, const void * A, int64_t lda,
                         const void * B, int64_t ldb, float * C, int64_t ldc, int Atype,
                         int ith, int nth) {
    if (n < 1 || !ggml_cpu_q8_gemm()) {
        return false;
    }
    const block_q8_0 * cols = (const block_q8_0 *) B;
    if (Atype == GGML_TYPE_Q8_0) {
        ggml_q8_gemm_rows(m, n, k, (const block_q8_0 *) A, lda, cols, ldb, C, ldc, ith, nth);
    } else if (Atype == GGML_TYPE_Q5_0) {
        ggml_q8_gemm_rows(m, n, k, (const block_q5_0 *) A, lda, cols, ldb, C, ldc, ith, nth);
    } else {
        return false;
    }
    return true;
}
#else
static bool ggml_q8_gemm(int64_t, int64_t, int64_t, const void *, int64_t, const void *, int64_t,
                         float *, int64_t, int, int, int) {
    return false;
}
#endif
