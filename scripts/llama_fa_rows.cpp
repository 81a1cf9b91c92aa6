// skiff: batch-invariant flash attention for several query rows at once (see skiff's
// scripts/llama_patch.py, GGML_CPU_FA_ROWS).
//
// Why: the exactness rule sends every query row through ggml's one-row loop, because the tiled
// kernel (64+ rows) and the split-KV path (a lone row past 512 cells) reduce in other orders. The
// one-row loop is slow for a prompt: each (row, cell) pays a dot with its own horizontal sum and an
// fp16 accumulator converted both ways, and every row walks the cache alone (~20% of a prefill).
//
// What a row computes here depends only on its own unmasked cells, in cell order, never on which
// rows share its tile, which cells the tile walks, how rows are chunked over threads, or where its
// cells sit in the cache:
//   1. s_c = dot(q, k_c): one fp32 FMA chain over the head's dimensions in order, in VL-wide lanes,
//      then a fixed horizontal sum; s_c = fma(s_c, scale, slope*mask_c);
//   2. M = max of s_c over unmasked cells (exact, so order does not matter);
//   3. p_c = expf(s_c - M); S = sum of p_c in cell order (scalar, sequential);
//   4. o[d] = fma(p_c, v_c[d], o[d]) in cell order from 0, in fp32, per lane d; then o[d] * (1/S).
// A cell masked for a row (-inf) is skipped by that row, as the one-row loop skips it. The exact
// max makes one pass over the softmax enough, with no rescaling; accumulating V in fp32 (the
// one-row loop keeps fp16) is also the more accurate of the two.
//
// Tiles: consecutive rows of a chunk that read the same K/V head and whose unmasked spans nearly
// coincide (a prompt's rows) share each K and V load; a cell masked for some of them is skipped by
// those rows only. Scores come in blocks of (rows x cells) FMA chains, V in blocks of cells that
// stay in L1. F16 K/V, F32 Q and mask-or-none only, no softcap, no sinks, head sizes a multiple of
// the vector width: anything else takes the one-row loop, as before (the choice depends on the
// layer, never on the batch).

static bool ggml_cpu_fa_rows(void) {
    static int cached = -1;
    return ggml_cpu_skiff_flag("GGML_CPU_FA_ROWS", &cached, 0);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define SKIFF_FA_VL 16
typedef __m512 skiff_fa_vec;
static inline skiff_fa_vec skiff_fa_zero(void) { return _mm512_setzero_ps(); }
static inline skiff_fa_vec skiff_fa_load(const float * p) { return _mm512_loadu_ps(p); }
static inline void skiff_fa_store(float * p, skiff_fa_vec v) { _mm512_storeu_ps(p, v); }
static inline skiff_fa_vec skiff_fa_load_f16(const ggml_fp16_t * p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p));
}
static inline skiff_fa_vec skiff_fa_bcast(const float * p) { return _mm512_set1_ps(*p); }
static inline skiff_fa_vec skiff_fa_fma(skiff_fa_vec a, skiff_fa_vec b, skiff_fa_vec c) {
    return _mm512_fmadd_ps(a, b, c);
}
static inline skiff_fa_vec skiff_fa_mul(skiff_fa_vec a, skiff_fa_vec b) { return _mm512_mul_ps(a, b); }
static inline skiff_fa_vec skiff_fa_sub(skiff_fa_vec a, skiff_fa_vec b) { return _mm512_sub_ps(a, b); }
static inline skiff_fa_vec skiff_fa_set1(float x) { return _mm512_set1_ps(x); }
static inline skiff_fa_vec skiff_fa_max(skiff_fa_vec a, skiff_fa_vec b) { return _mm512_max_ps(a, b); }
static inline float skiff_fa_hmax(skiff_fa_vec v) { return _mm512_reduce_max_ps(v); }
// b where a != -inf, else 0
static inline skiff_fa_vec skiff_fa_where_finite(skiff_fa_vec a, skiff_fa_vec b) {
    const __mmask16 on = _mm512_cmp_ps_mask(a, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm512_maskz_mov_ps(on, b);
}
// a where m != -inf, else -inf
static inline skiff_fa_vec skiff_fa_keep(skiff_fa_vec a, skiff_fa_vec m) {
    const __mmask16 on = _mm512_cmp_ps_mask(m, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), on, a);
}
static inline float skiff_fa_hsum(skiff_fa_vec v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define SKIFF_FA_VL 8
typedef __m256 skiff_fa_vec;
static inline skiff_fa_vec skiff_fa_zero(void) { return _mm256_setzero_ps(); }
static inline skiff_fa_vec skiff_fa_load(const float * p) { return _mm256_loadu_ps(p); }
static inline void skiff_fa_store(float * p, skiff_fa_vec v) { _mm256_storeu_ps(p, v); }
static inline skiff_fa_vec skiff_fa_load_f16(const ggml_fp16_t * p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p));
}
static inline skiff_fa_vec skiff_fa_bcast(const float * p) { return _mm256_broadcast_ss(p); }
static inline skiff_fa_vec skiff_fa_fma(skiff_fa_vec a, skiff_fa_vec b, skiff_fa_vec c) {
    return _mm256_fmadd_ps(a, b, c);
}
static inline skiff_fa_vec skiff_fa_mul(skiff_fa_vec a, skiff_fa_vec b) { return _mm256_mul_ps(a, b); }
static inline skiff_fa_vec skiff_fa_sub(skiff_fa_vec a, skiff_fa_vec b) { return _mm256_sub_ps(a, b); }
static inline skiff_fa_vec skiff_fa_set1(float x) { return _mm256_set1_ps(x); }
static inline skiff_fa_vec skiff_fa_max(skiff_fa_vec a, skiff_fa_vec b) { return _mm256_max_ps(a, b); }
static inline float skiff_fa_hmax(skiff_fa_vec v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
static inline skiff_fa_vec skiff_fa_where_finite(skiff_fa_vec a, skiff_fa_vec b) {
    const __m256 on = _mm256_cmp_ps(a, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm256_and_ps(on, b);
}
static inline skiff_fa_vec skiff_fa_keep(skiff_fa_vec a, skiff_fa_vec m) {
    const __m256 on = _mm256_cmp_ps(m, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), a, on);
}
static inline float skiff_fa_hsum(skiff_fa_vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

enum { SKIFF_FA_ROWS = 8, SKIFF_FA_VBLOCK = 32 };

// R x C dots, each one chain over the dimensions in order (the same for any R, C)
template <int R, int C>
static void skiff_fa_dots(const float * const * q, const ggml_fp16_t * const * k, int64_t dk,
                          float * s, int64_t stride, const int32_t * cols) {
    skiff_fa_vec acc[R][C];
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            acc[r][c] = skiff_fa_zero();
        }
    }
    for (int64_t d = 0; d < dk; d += SKIFF_FA_VL) {
        skiff_fa_vec qv[R];
        for (int r = 0; r < R; ++r) {
            qv[r] = skiff_fa_load(q[r] + d);
        }
        for (int c = 0; c < C; ++c) {
            const skiff_fa_vec kv = skiff_fa_load_f16(k[c] + d);
            for (int r = 0; r < R; ++r) {
                acc[r][c] = skiff_fa_fma(qv[r], kv, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            s[r * stride + cols[c]] = skiff_fa_hsum(acc[r][c]);
        }
    }
}

template <int R>
static void skiff_fa_scores(const float * const * q, const char * k0, size_t nbk1, int64_t dk,
                            const int32_t * cells, int64_t n_cells, float * s, int64_t stride) {
    // cells per block: as many chains as the registers hold beside Q and K
#if SKIFF_FA_VL == 16
    constexpr int C = R == 1 ? 8 : R == 2 ? 6 : R <= 4 ? 4 : 2;
#else
    constexpr int C = R == 1 ? 8 : R == 2 ? 4 : R <= 4 ? 2 : 1;
#endif
    int64_t i = 0;
    for (; i + C <= n_cells; i += C) {
        const ggml_fp16_t * k[C];
        for (int c = 0; c < C; ++c) {
            k[c] = (const ggml_fp16_t *) (k0 + cells[i + c] * nbk1);
        }
        skiff_fa_dots<R, C>(q, k, dk, s, stride, cells + i);
    }
    for (; i < n_cells; ++i) {
        const ggml_fp16_t * k[1] = { (const ggml_fp16_t *) (k0 + cells[i] * nbk1) };
        skiff_fa_dots<R, 1>(q, k, dk, s, stride, cells + i);
    }
}

// o_r[d] = fma(p_r[c], v_c[d], o_r[d]) over the cells in order, for the rows that see each cell
// (the cells in blocks that stay in L1, DC vector columns at a time)
template <int R>
static void skiff_fa_values(const float * p, int64_t stride, const uint8_t * seen,
                            const char * v0, size_t nbv1, const int32_t * cells, int64_t n_cells,
                            int64_t dv, float * o) {
#if SKIFF_FA_VL == 16
    constexpr int DC = R <= 4 ? 4 : 2;
#else
    constexpr int DC = R <= 2 ? 4 : R <= 4 ? 2 : 1;
#endif
    const uint8_t all = (uint8_t) ((1u << R) - 1);
    for (int64_t i0 = 0; i0 < n_cells; i0 += SKIFF_FA_VBLOCK) {
        const int64_t i1 = std::min<int64_t>(i0 + SKIFF_FA_VBLOCK, n_cells);
        int64_t d = 0;
        for (; d + DC * SKIFF_FA_VL <= dv; d += DC * SKIFF_FA_VL) {
            skiff_fa_vec acc[R][DC];
            for (int r = 0; r < R; ++r) {
                for (int j = 0; j < DC; ++j) {
                    acc[r][j] = skiff_fa_load(o + r * dv + d + j * SKIFF_FA_VL);
                }
            }
            for (int64_t i = i0; i < i1; ++i) {
                const int32_t c = cells[i];
                const ggml_fp16_t * vc = (const ggml_fp16_t *) (v0 + c * nbv1) + d;
                skiff_fa_vec v[DC];
                for (int j = 0; j < DC; ++j) {
                    v[j] = skiff_fa_load_f16(vc + j * SKIFF_FA_VL);
                }
                for (int r = 0; r < R; ++r) {
                    if (seen[c] == all || (seen[c] >> r & 1)) {
                        const skiff_fa_vec pr = skiff_fa_bcast(p + r * stride + c);
                        for (int j = 0; j < DC; ++j) {
                            acc[r][j] = skiff_fa_fma(pr, v[j], acc[r][j]);
                        }
                    }
                }
            }
            for (int r = 0; r < R; ++r) {
                for (int j = 0; j < DC; ++j) {
                    skiff_fa_store(o + r * dv + d + j * SKIFF_FA_VL, acc[r][j]);
                }
            }
        }
        for (; d < dv; d += SKIFF_FA_VL) {  // what is left of the head, one column at a time
            skiff_fa_vec acc[R];
            for (int r = 0; r < R; ++r) {
                acc[r] = skiff_fa_load(o + r * dv + d);
            }
            for (int64_t i = i0; i < i1; ++i) {
                const int32_t c = cells[i];
                const skiff_fa_vec v = skiff_fa_load_f16((const ggml_fp16_t *) (v0 + c * nbv1) + d);
                for (int r = 0; r < R; ++r) {
                    if (seen[c] >> r & 1) {
                        acc[r] = skiff_fa_fma(skiff_fa_bcast(p + r * stride + c), v, acc[r]);
                    }
                }
            }
            for (int r = 0; r < R; ++r) {
                skiff_fa_store(o + r * dv + d, acc[r]);
            }
        }
    }
}

// slope * mask for VL cells from c (n of them real; the rest -inf, as if masked)
static inline skiff_fa_vec skiff_fa_mask(const ggml_fp16_t * mp, float slope, int64_t c, int64_t n) {
    if (n == SKIFF_FA_VL) {
        return mp ? skiff_fa_mul(skiff_fa_set1(slope), skiff_fa_load_f16(mp + c)) : skiff_fa_zero();
    }
    float m[SKIFF_FA_VL];
    for (int64_t j = 0; j < SKIFF_FA_VL; ++j) {
        m[j] = j >= n ? -INFINITY : mp ? slope * GGML_CPU_FP16_TO_FP32(mp[c + j]) : 0.0f;
    }
    return skiff_fa_load(m);
}

// one row's softmax numerators over its scores, in place (s_c -> p_c, 0 where masked). Lane-wise
// arithmetic and an exact max: the result for a cell does not depend on its lane, its block or the
// row's tile.
static void skiff_fa_softmax(float * s, const ggml_fp16_t * mp, float slope, float scale,
                             int64_t lo, int64_t hi) {
    skiff_fa_vec mx = skiff_fa_set1(-INFINITY);
    const skiff_fa_vec sc = skiff_fa_set1(scale);
    for (int64_t c = lo; c < hi; c += SKIFF_FA_VL) {
        const skiff_fa_vec mv = skiff_fa_mask(mp, slope, c, std::min<int64_t>(SKIFF_FA_VL, hi - c));
        const skiff_fa_vec x = skiff_fa_keep(skiff_fa_fma(skiff_fa_load(s + c), sc, mv), mv);
        skiff_fa_store(s + c, x);
        mx = skiff_fa_max(mx, x);
    }
    const skiff_fa_vec M = skiff_fa_set1(skiff_fa_hmax(mx));
    for (int64_t c = lo; c < hi; c += SKIFF_FA_VL) {
        const skiff_fa_vec x = skiff_fa_load(s + c);
        skiff_fa_store(s + c, skiff_fa_where_finite(x, ggml_v_expf(skiff_fa_sub(x, M))));
    }
}

struct skiff_fa_scratch {
    std::vector<float>   s;     // rows x cells: scores, then probabilities
    std::vector<float>   o;     // rows x dv accumulators
    std::vector<uint8_t> seen;  // per cell: which rows of the tile see it
    std::vector<int32_t> cells; // the cells any row sees, in order
};

static bool ggml_fa_rows_supported(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    float softcap = 0.0f;
    memcpy(&softcap, (const float *) dst->op_params + 2, sizeof(float));
    return q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16 &&
           (mask == NULL || mask->type == GGML_TYPE_F16) && dst->src[4] == NULL && softcap == 0.0f &&
           k->ne[0] % SKIFF_FA_VL == 0 && v->ne[0] % SKIFF_FA_VL == 0 && k->nb[0] == sizeof(ggml_fp16_t) &&
           v->nb[0] == sizeof(ggml_fp16_t) && q->nb[0] == sizeof(float);
}

// rows ir0..ir1 of the op (as ggml_compute_forward_flash_attn_ext_f16_one_chunk numbers them)
static void ggml_fa_rows(const ggml_compute_params * params, ggml_tensor * dst, int64_t ir0, int64_t ir1) {
    GGML_UNUSED(params);
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    const int64_t DK = k->ne[0], DV = v->ne[0], n_kv = k->ne[1];
    const int64_t neq1 = q->ne[1], neq2 = q->ne[2], neq3 = q->ne[3];
    const int64_t rk2 = neq2 / k->ne[2], rk3 = neq3 / k->ne[3];
    const int64_t rv2 = neq2 / v->ne[2], rv3 = neq3 / v->ne[3];

    float scale = 1.0f, max_bias = 0.0f;
    memcpy(&scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    const uint32_t n_head      = (uint32_t) neq2;
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));
    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);

    // a row's scores, padded: the softmax reads and writes whole vectors past its last cell
    const int64_t stride = (n_kv + 2 * SKIFF_FA_VL - 1) / SKIFF_FA_VL * SKIFF_FA_VL;
    static thread_local skiff_fa_scratch sc;
    if ((int64_t) sc.seen.size() < n_kv) {
        sc.seen.resize(n_kv);
        sc.cells.resize(n_kv);
    }
    if ((int64_t) sc.s.size() < SKIFF_FA_ROWS * stride) {
        sc.s.resize(SKIFF_FA_ROWS * stride);
    }
    if ((int64_t) sc.o.size() < SKIFF_FA_ROWS * DV) {
        sc.o.resize(SKIFF_FA_ROWS * DV);
    }
    uint8_t * seen = sc.seen.data();

    struct row_t { int64_t iq1, iq2, iq3, lo, hi; const ggml_fp16_t * mp; float slope; };

    auto row_of = [&](int64_t ir) {
        row_t r;
        r.iq3 = ir / (neq2 * neq1);
        r.iq2 = (ir - r.iq3 * neq2 * neq1) / neq1;
        r.iq1 = ir - r.iq3 * neq2 * neq1 - r.iq2 * neq1;
        const uint32_t h = (uint32_t) r.iq2;
        r.slope = max_bias > 0.0f ? (h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2 * (h - n_head_log2) + 1)) : 1.0f;
        r.mp = mask ? (const ggml_fp16_t *) ((const char *) mask->data + r.iq1 * mask->nb[1] +
                                            (r.iq2 % mask->ne[2]) * mask->nb[2] + (r.iq3 % mask->ne[3]) * mask->nb[3])
                    : NULL;
        r.lo = 0;
        r.hi = n_kv;
        if (r.mp) {  // the span of cells this row sees
            while (r.lo < n_kv && r.slope * GGML_CPU_FP16_TO_FP32(r.mp[r.lo]) == -INFINITY) {
                ++r.lo;
            }
            while (r.hi > r.lo && r.slope * GGML_CPU_FP16_TO_FP32(r.mp[r.hi - 1]) == -INFINITY) {
                --r.hi;
            }
        }
        return r;
    };

    int64_t ir = ir0;
    while (ir < ir1) {
        row_t rows[SKIFF_FA_ROWS];
        rows[0] = row_of(ir++);
        int R = 1;
        int64_t lo = rows[0].lo, hi = rows[0].hi, widest = hi - lo;
        const int64_t kv2 = rows[0].iq2 / rk2, kv3 = rows[0].iq3 / rk3;
        const int64_t vv2 = rows[0].iq2 / rv2, vv3 = rows[0].iq3 / rv3;
        while (ir < ir1 && R < SKIFF_FA_ROWS) {
            const row_t r = row_of(ir);
            if (r.iq2 / rk2 != kv2 || r.iq3 / rk3 != kv3 || r.iq2 / rv2 != vv2 || r.iq3 / rv3 != vv3) {
                break;
            }
            // a tile walks the union of its rows' spans: join only rows that add little to it
            const int64_t nlo = std::min(lo, r.lo), nhi = std::max(hi, r.hi);
            if (nhi - nlo > std::max(widest, r.hi - r.lo) + 64) {
                break;
            }
            lo = nlo;
            hi = nhi;
            widest = std::max(widest, r.hi - r.lo);
            rows[R++] = r;
            ++ir;
        }

        // which rows see each cell of the union, and the cells any row sees
        int64_t n_cells = 0;
        for (int64_t c = lo; c < hi; ++c) {
            uint8_t bits = 0;
            for (int r = 0; r < R; ++r) {
                const bool on = rows[r].mp == NULL ||
                                rows[r].slope * GGML_CPU_FP16_TO_FP32(rows[r].mp[c]) != -INFINITY;
                bits |= (uint8_t) (on << r);
            }
            seen[c] = bits;
            if (bits) {
                sc.cells[n_cells++] = (int32_t) c;
            }
        }

        const float * qp[SKIFF_FA_ROWS];
        for (int r = 0; r < R; ++r) {
            qp[r] = (const float *) ((const char *) q->data + rows[r].iq1 * q->nb[1] + rows[r].iq2 * q->nb[2] +
                                     rows[r].iq3 * q->nb[3]);
        }
        const char * k0 = (const char *) k->data + kv2 * k->nb[2] + kv3 * k->nb[3];
        const char * v0 = (const char *) v->data + vv2 * v->nb[2] + vv3 * v->nb[3];
        float * s = sc.s.data();
        const int32_t * cells = sc.cells.data();
        switch (R) {
            case 1: skiff_fa_scores<1>(qp, k0, k->nb[1], DK, cells, n_cells, s, stride); break;
            case 2: skiff_fa_scores<2>(qp, k0, k->nb[1], DK, cells, n_cells, s, stride); break;
            case 3: skiff_fa_scores<3>(qp, k0, k->nb[1], DK, cells, n_cells, s, stride); break;
            case 4: skiff_fa_scores<4>(qp, k0, k->nb[1], DK, cells, n_cells, s, stride); break;
            case 5: skiff_fa_scores<5>(qp, k0, k->nb[1], DK, cells, n_cells, s, stride); break;
            case 6: skiff_fa_scores<6>(qp, k0, k->nb[1], DK, cells, n_cells, s, stride); break;
            case 7: skiff_fa_scores<7>(qp, k0, k->nb[1], DK, cells, n_cells, s, stride); break;
            default: skiff_fa_scores<8>(qp, k0, k->nb[1], DK, cells, n_cells, s, stride); break;
        }
        for (int r = 0; r < R; ++r) {
            skiff_fa_softmax(s + r * stride, rows[r].mp, rows[r].slope, scale, rows[r].lo, rows[r].hi);
        }
        // S: each row's numerators summed in cell order (rows interleaved, each its own chain)
        float S[SKIFF_FA_ROWS] = { 0.0f };
        for (int64_t i = 0; i < n_cells; ++i) {
            const int32_t c = cells[i];
            for (int r = 0; r < R; ++r) {
                if (seen[c] >> r & 1) {
                    S[r] += s[r * stride + c];
                }
            }
        }
        float s_inv[SKIFF_FA_ROWS];
        for (int r = 0; r < R; ++r) {
            s_inv[r] = S[r] == 0.0f ? 0.0f : 1.0f / S[r];
        }
        float * o = sc.o.data();
        memset(o, 0, R * DV * sizeof(float));
        switch (R) {
            case 1: skiff_fa_values<1>(s, stride, seen, v0, v->nb[1], cells, n_cells, DV, o); break;
            case 2: skiff_fa_values<2>(s, stride, seen, v0, v->nb[1], cells, n_cells, DV, o); break;
            case 3: skiff_fa_values<3>(s, stride, seen, v0, v->nb[1], cells, n_cells, DV, o); break;
            case 4: skiff_fa_values<4>(s, stride, seen, v0, v->nb[1], cells, n_cells, DV, o); break;
            case 5: skiff_fa_values<5>(s, stride, seen, v0, v->nb[1], cells, n_cells, DV, o); break;
            case 6: skiff_fa_values<6>(s, stride, seen, v0, v->nb[1], cells, n_cells, DV, o); break;
            case 7: skiff_fa_values<7>(s, stride, seen, v0, v->nb[1], cells, n_cells, DV, o); break;
            default: skiff_fa_values<8>(s, stride, seen, v0, v->nb[1], cells, n_cells, DV, o); break;
        }
        for (int r = 0; r < R; ++r) {
            const skiff_fa_vec inv = skiff_fa_bcast(&s_inv[r]);
            // permute(0, 2, 1, 3), as the one-row loop writes it
            float * out = (float *) ((char *) dst->data + (rows[r].iq3 * dst->ne[2] * dst->ne[1] + rows[r].iq2 +
                                                           rows[r].iq1 * dst->ne[1]) * dst->nb[1]);
            for (int64_t d = 0; d < DV; d += SKIFF_FA_VL) {
                skiff_fa_store(out + d, skiff_fa_mul(skiff_fa_load(o + r * DV + d), inv));
            }
        }
    }
}

#else

static bool ggml_fa_rows_supported(const ggml_tensor * dst) {
    GGML_UNUSED(dst);
    return false;
}

static void ggml_fa_rows(const ggml_compute_params * params, ggml_tensor * dst, int64_t ir0, int64_t ir1) {
    GGML_UNUSED(params);
    GGML_UNUSED(dst);
    GGML_UNUSED(ir0);
    GGML_UNUSED(ir1);
}

#endif
