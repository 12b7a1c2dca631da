/* Fused loops over float32 gradients on the CPU, for grace's Ops adapters (grace/native/__init__.py).
 *
 * Each kernel does in one pass over memory what the composite Ops code does in several, and gives the
 * same bits: float32 arithmetic in the same order (built with -ffp-contract=off and without
 * -ffast-math, so no fused multiply-add and no reassociation), the same counter-based random numbers
 * (grace/ops.py: counter_uniform) and the same bit packing (Ops.pack_bits: codes least significant bit
 * first, bytes filled from their lowest bit). Each works on a range [start, start + n) of elements, so
 * that Python threads can run disjoint ranges at once (ctypes releases the GIL); a range that packs
 * bits starts at a multiple of 8 elements, so it starts on a byte.
 */
#include "common.h"

/* n uniform float32 draws in [0, 1) for elements [start, start + n): grace/rng.py's counter_uniform. */
void grace_uniform(uint32_t k0, uint32_t k1, int64_t start, int64_t n, float *out) {
    draw_uniform(k0, k1, start, n, out + start);
}

/* Stochastic rounding to levels, sign-magnitude codes (QSGD; TernGrad with one level), in blocks of
 * `block` elements each divided by its own divisor: level = (|x| / divisors[i / block]) * levels;
 * q = min(floor(level) + (u < level - floor(level)), levels); code = 2 q + (x < 0). Saturating at
 * `levels` clips the elements beyond the divisor to it (TernGrad's clipping). */
void grace_quantize_levels(const float *x, int64_t start, int64_t n, const float *divisors,
                           int64_t block, float levels, uint32_t k0, uint32_t k1, int bits,
                           uint8_t *out) {
    float u[BLOCK];
    uint8_t codes[BLOCK];
    uint8_t mask = (uint8_t)((1U << bits) - 1U);
    out += start * bits / 8;  /* this range's first byte */
    int64_t block_at = start / block, left = block - start % block;  /* elements left in it */
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const float *p = x + start + b;
        draw_uniform(k0, k1, start + b, m, u);
        for (int64_t j = 0; j < m; j++) {
            if (left == 0) {
                block_at++;
                left = block;
            }
            left--;
            float v = p[j];
            float level = (fabsf(v) / divisors[block_at]) * levels;
            float low = floorf(level);
            float q = low + (u[j] < level - low ? 1.0f : 0.0f);
            q = q < levels ? q : levels;
            /* A non-finite level (that step is dropped by the non-finite flag) must not be UB. */
            q = q >= 0.0f ? q : 0.0f;
            int32_t code = (int32_t)q * 2 + (v < 0.0f ? 1 : 0);
            codes[j] = (uint8_t)code & mask;
        }
        pack(codes, m, bits, out + (b * bits) / 8);
    }
}

/* Per block of `block` elements (blocks [first, first + count) of the n elements of x, `total` in
 * all): the count of x >= 0, the float64 sums of those and of the others, and the float64 sum of
 * squares, as 4 rows of `total` doubles. */
void grace_block_sums(const float *x, int64_t n, int64_t block, int64_t first, int64_t count,
                      int64_t total, double *out) {
    for (int64_t k = first; k < first + count; k++) {
        const float *p = x + k * block;
        int64_t m = (k + 1) * block <= n ? block : n - k * block;
        int64_t nonnegative = 0;
        v4d positive = {0}, negative = {0}, squares = {0};
        int64_t whole = m - m % 4;
        for (int64_t j = 0; j < whole; j += 4) {
            v4f f = load4(p + j);
            v4d d = __builtin_convertvector(f, v4d);
            v4l keep = __builtin_convertvector(f >= 0.0f, v4l);
            positive += (v4d)((v4l)d & keep);
            negative += (v4d)((v4l)d & ~keep);
            squares += d * d;
            nonnegative -= keep[0] + keep[1] + keep[2] + keep[3];  /* true lanes are -1 */
        }
        double pos = total4(positive), neg = total4(negative), sq = total4(squares);
        for (int64_t j = whole; j < m; j++) {
            double v = (double)p[j];
            if (p[j] >= 0.0f) { pos += v; nonnegative++; } else neg += v;
            sq += v * v;
        }
        out[k] = (double)nonnegative;
        out[total + k] = pos;
        out[2 * total + k] = neg;
        out[3 * total + k] = sq;
    }
}

/* One element of grace_unpack_blocks: the table's value for code i, plus base[i] where base is set. */
static inline float unpack_one(const uint8_t *packed, int bits, int shift, uint32_t mask, int64_t i,
                               const float *t, const float *base) {
    int64_t per = (int64_t)1 << shift;
    float v = t[(packed[i >> shift] >> (bits * (i & (per - 1)))) & mask];
    return base ? base[i] + v : v;
}

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* Eight elements of one bit each, from one byte: the byte's bits select, lane by lane, t1 (bit set)
 * or t0 as bit patterns; a select copies a value exactly, so the bits are those of the lookup. */
static inline void unpack_byte_1bit(uint8_t byte, v8i t0, v8i t1, const float *base, float *out) {
    const v8i lanes = {1, 2, 4, 8, 16, 32, 64, 128};
    v8i set = ((v8i){byte, byte, byte, byte, byte, byte, byte, byte} & lanes) != 0;  /* -1 or 0 */
    v8f v = (v8f)((set & t1) | (~set & t0));
    if (base) {
        v8f b;
        memcpy(&b, base, sizeof b);
        v = b + v;
    }
    memcpy(out, &v, sizeof v);
}

/* tables[(i / block) * 2^bits + code] for the codes of elements [start, start + n): decoding with one
 * small table per block (a scale per block). bits divides 8. With base (else NULL), base[i] plus
 * that: a decoded tensor added to another in the same pass. Whole bytes of a block are decoded
 * together (one bit: eight lanes at once), the ends one element at a time. */
void grace_unpack_blocks(const uint8_t *packed, int bits, int64_t start, int64_t n, const float *tables,
                         int64_t block, const float *base, float *out) {
    uint32_t mask = (1U << bits) - 1U;
    int shift = bits == 1 ? 3 : bits == 2 ? 2 : bits == 4 ? 1 : 0;  /* log2 of codes per byte */
    int64_t per = (int64_t)1 << shift;
    for (int64_t lo = start; lo < start + n;) {
        int64_t k = lo / block;
        int64_t hi = (k + 1) * block < start + n ? (k + 1) * block : start + n;
        const float *t = tables + k * ((int64_t)1 << bits);
        int64_t i = lo;
        for (; i < hi && (i & (per - 1)); i++) out[i] = unpack_one(packed, bits, shift, mask, i, t, base);
        int64_t whole = i + (hi - i) / per * per;  /* the end of the block's whole bytes */
        if (bits == 1) {
            v8i t0, t1;
            for (int j = 0; j < 8; j++) {
                memcpy(&t0[j], &t[0], sizeof(float));
                memcpy(&t1[j], &t[1], sizeof(float));
            }
            for (; i < whole; i += 8) unpack_byte_1bit(packed[i >> 3], t0, t1, base ? base + i : NULL, out + i);
        } else {
            /* A table lookup per code, not a branch on it: the codes of a gradient are random. */
            for (; i < whole; i += per) {
                uint32_t byte = packed[i >> shift];
                for (int64_t j = 0; j < per; j++, byte >>= bits)
                    out[i + j] = base ? base[i + j] + t[byte & mask] : t[byte & mask];
            }
        }
        for (; i < hi; i++) out[i] = unpack_one(packed, bits, shift, mask, i, t, base);
        lo = hi;
    }
}

/* One bit per element, 1 where x >= 0. */
void grace_sign_bits(const float *x, int64_t start, int64_t n, uint8_t *out) {
    uint8_t codes[BLOCK];
    out += start / 8;  /* this range's first byte */
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const float *p = x + start + b;
        for (int64_t j = 0; j < m; j++) codes[j] = (uint8_t)(p[j] >= 0.0f);
        pack(codes, m, 1, out + b / 8);
    }
}

/* values[code] for the codes of elements [start, start + n). */
void grace_unpack_values(const uint8_t *packed, int bits, int64_t start, int64_t n, const float *values,
                         float *out) {
    uint32_t mask = (1U << bits) - 1U;
    if (8 % bits == 0 && start % (8 / bits) == 0) {
        /* A table from each byte value to the values of its codes: one copy of 8 / bits floats
         * per byte of input. */
        int per = 8 / bits;
        float table[256 * 8];
        for (int v = 0; v < 256; v++)
            for (int j = 0; j < per; j++) table[v * per + j] = values[(v >> (bits * j)) & mask];
        const uint8_t *src = packed + start / per;
        float *dst = out + start;
        int64_t whole = n / per;
        if (bits == 1) {
            for (int64_t b = 0; b < whole; b++) memcpy(dst + b * 8, table + src[b] * 8, sizeof(float) * 8);
        } else if (bits == 2) {
            for (int64_t b = 0; b < whole; b++) memcpy(dst + b * 4, table + src[b] * 4, sizeof(float) * 4);
        } else if (bits == 4) {
            for (int64_t b = 0; b < whole; b++) memcpy(dst + b * 2, table + src[b] * 2, sizeof(float) * 2);
        } else {
            for (int64_t b = 0; b < whole; b++) dst[b] = table[src[b]];
        }
        for (int64_t j = whole * per; j < n; j++) dst[j] = table[src[j / per] * per + j % per];
        return;
    }
    for (int64_t i = start; i < start + n; i++) {
        int64_t bit = i * bits;
        uint32_t word = packed[bit / 8];
        if ((bit % 8) + bits > 8) word |= (uint32_t)packed[bit / 8 + 1] << 8;
        out[i] = values[(word >> (bit % 8)) & mask];
    }
}

/* Float64 sum and sum of squares, and the largest |x| (NaN if any element is NaN: the sum is). */
void grace_sums(const float *x, int64_t start, int64_t n, double *out) {
    v4d s = {0}, s2 = {0};
    v4f top = {0};
    const float *p = x + start;
    int64_t whole = n - n % 4;
    for (int64_t i = 0; i < whole; i += 4) {
        v4f f = load4(p + i);
        v4d d = __builtin_convertvector(f, v4d);
        s += d;
        s2 += d * d;
        v4f a = (v4f)((v4i)f & 0x7fffffff);
        v4i larger = a > top;
        top = (v4f)(((v4i)a & larger) | ((v4i)top & ~larger));
    }
    double total = total4(s), squares = total4(s2);
    float largest = 0.0f;
    for (int j = 0; j < 4; j++) largest = top[j] > largest ? top[j] : largest;
    for (int64_t i = whole; i < n; i++) {
        total += (double)p[i];
        squares += (double)p[i] * (double)p[i];
        largest = fabsf(p[i]) > largest ? fabsf(p[i]) : largest;
    }
    out[0] = total;
    out[1] = squares;
    out[2] = total != total ? (double)NAN : (double)largest;
}

/* out = a * alpha + b * beta in float32, each product rounded, then the sum (a may be NULL: b * beta). */
void grace_scaled_sum(const float *a, float alpha, const float *b, float beta, int64_t start, int64_t n,
                      float *out) {
    if (a) {
        for (int64_t i = start; i < start + n; i++) {
            float left = a[i] * alpha;
            float right = b[i] * beta;
            out[i] = left + right;
        }
    } else {
        for (int64_t i = start; i < start + n; i++) out[i] = b[i] * beta;
    }
}

/* How many i in [start, start + n) have |x[i]| >= threshold. */
int64_t grace_count_above(const float *x, int64_t start, int64_t n, float threshold) {
    int64_t count = 0;
    for (int64_t i = start; i < start + n; i++) count += fabsf(x[i]) >= threshold;
    return count;
}

/* Which of the SKIP elements from x are selected, as the bits of a mask (bit j for x[j]): those with
 * |x| >= t, and with nan_too NaN as well. A selection keeps a few elements in a hundred, so a
 * scan tests SKIP at a time, with the CPU's vector compare where it has one, and walks the set bits
 * of the few masks that have some: 3 times faster than writing every index branch-free. */
#define SKIP 16

static inline uint32_t tail_mask(const float *x, int64_t m, float t, int nan_too) {
    uint32_t mask = 0;
    for (int64_t j = 0; j < m; j++) mask |= (uint32_t)(fabsf(x[j]) >= t || (nan_too && x[j] != x[j])) << j;
    return mask;
}

static inline uint32_t block_mask(const float *x, float t, int nan_too) {
#if defined(__AVX512F__)
    __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x)), u = _mm512_set1_ps(t);
    return nan_too ? _mm512_cmp_ps_mask(v, u, _CMP_NLT_UQ) : _mm512_cmp_ps_mask(v, u, _CMP_GE_OQ);
#elif defined(__AVX__)
    __m256 sign = _mm256_set1_ps(-0.0f), u = _mm256_set1_ps(t);
    __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x)), b = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8));
    if (nan_too)
        return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, u, _CMP_NLT_UQ))
               | (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(b, u, _CMP_NLT_UQ)) << 8;
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, u, _CMP_GE_OQ))
           | (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(b, u, _CMP_GE_OQ)) << 8;
#else
    return tail_mask(x, SKIP, t, nan_too);
#endif
}

static inline uint32_t mask_at(const float *x, int64_t i, int64_t end, float t, int nan_too) {
    return end - i >= SKIP ? block_mask(x + i, t, nan_too) : tail_mask(x + i, end - i, t, nan_too);
}

/* The indices i in [start, start + n) with |x[i]| >= threshold, in order, written to out (int64,
 * or int32 where wide is 0). */
void grace_select_above(const float *x, int64_t start, int64_t n, float threshold, void *out, int wide) {
    int64_t count = 0, end = start + n;
    int64_t *o64 = out;
    int32_t *o32 = out;
    for (int64_t i = start; i < end; i += SKIP) {
        for (uint32_t mask = mask_at(x, i, end, threshold, 0); mask; mask &= mask - 1) {
            int64_t j = i + __builtin_ctz(mask);
            if (wide) o64[count++] = j; else o32[count++] = (int32_t)j;
        }
    }
}

/* out[indices[j]] += values[j] for j < k (indices int32, or int64 where wide); repeats add up. An
 * index outside [0, n) stops the loop: the return value is its position j, or -1 when all fit. */
int64_t grace_scatter_add(float *out, int64_t n, const void *indices, int wide, const float *values,
                          int64_t k) {
    if (wide) {
        const int64_t *idx = indices;
        for (int64_t j = 0; j < k; j++) {
            if (idx[j] < 0 || idx[j] >= n) return j;
            out[idx[j]] += values[j];
        }
    } else {
        const int32_t *idx = indices;
        for (int64_t j = 0; j < k; j++) {
            if (idx[j] < 0 || idx[j] >= n) return j;
            out[idx[j]] += values[j];
        }
    }
    return -1;
}

static inline float float_of(uint32_t raw) {
    float v;
    memcpy(&v, &raw, sizeof v);
    return v;
}

/* The index bin_of reads, for `count` ascending boundaries and keys of 32 - shift bits: for each
 * key, how many boundaries are <= the lowest and the highest float with those top bits (0 and 0 for
 * NaN keys). The positive keys grow in value with the key and the negative ones shrink, so each half
 * is one sweep with two pointers that only move forward. */
void grace_bin_index(const float *boundaries, int32_t count, int shift, int32_t *low, int32_t *high) {
    uint32_t keys = 1U << (32 - shift), half = keys / 2, fill = (1U << shift) - 1U;
    for (int side = 0; side < 2; side++) {
        int32_t p_low = 0, p_high = 0;
        for (uint32_t j = 0; j < half; j++) {
            uint32_t key = side == 0 ? j : keys - 1 - j;
            float a = float_of(key << shift), b = float_of((key << shift) | fill);
            /* The extremes of the two ends, a NaN end left out (both NaN: a NaN key). */
            if (a != a) a = b;
            if (b != b) b = a;
            float lowest = a < b ? a : b, highest = a < b ? b : a;
            if (lowest != lowest) {
                low[key] = high[key] = 0;
                continue;
            }
            while (p_low < count && boundaries[p_low] <= lowest) p_low++;
            while (p_high < count && boundaries[p_high] <= highest) p_high++;
            low[key] = p_low;
            high[key] = p_high;
        }
    }
}

/* Top-k by magnitude (grace/ops.py: Ops.topk_indices). An element's magnitude is |x|, NaN counting
 * as infinite, so that every comparison below is a total order. */
static inline float magnitude(float v) {
    float m = fabsf(v);
    return m != m ? INFINITY : m;
}

static int descending(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* The r-th largest (from 0) of v[0, m), reordering v: quickselect with a median-of-three pivot,
 * finished by a sort of what is left after 64 rounds (so no quadratic worst case). */
static float kth_largest(float *v, int64_t m, int64_t r) {
    int64_t lo = 0, hi = m - 1;
    for (int round = 0; lo < hi; round++) {
        if (round == 64) {
            qsort(v + lo, (size_t)(hi - lo + 1), sizeof(float), descending);
            break;
        }
        float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi];
        float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        /* Now v[lo, j] >= pivot >= v[i, hi], and what lies between equals the pivot. */
        if (r <= j) hi = j;
        else if (r >= i) lo = i;
        else return pivot;
    }
    return v[r];
}

/* The r-th largest (from 0) of the c non-negative floats m, without reordering them: a radix
 * selection on their bits (which order non-negative floats as integers), 11, 11 and 10 bits at a
 * time; each pass counts, in 2048 bins, the values that share the bits found so far. */
static float kth_largest_bits(const float *m, int64_t c, int64_t r) {
    static const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    uint32_t prefix = 0, known = 0;
    int64_t bins[2048];
    for (int pass = 0; pass < 3; pass++) {
        uint32_t width = (1u << widths[pass]) - 1;
        memset(bins, 0, sizeof(bins));
        for (int64_t j = 0; j < c; j++) {
            uint32_t u;
            memcpy(&u, m + j, sizeof(u));
            if ((u & known) == prefix) bins[(u >> shifts[pass]) & width]++;
        }
        int64_t b = (int64_t)width;
        while (r >= bins[b]) r -= bins[b--];
        prefix |= (uint32_t)b << shifts[pass];
        known |= width << shifts[pass];
    }
    float kth;
    memcpy(&kth, &prefix, sizeof(kth));
    return kth;
}

/* How many of x[0, n) have a magnitude of at least t. */
static int64_t count_at_least(const float *x, int64_t n, float t) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i += SKIP) count += __builtin_popcount(mask_at(x, i, n, t, 1));
    return count;
}

/* The k (< n) indices of x[0, n) of largest magnitude, in ascending order, into out (int64, or
 * int32 where wide is 0); of the elements equal to the k-th largest magnitude, the lowest indices
 * (as TensorFlow's top_k and the composite code choose). From 2^15 elements, with k at most an
 * eighth of them, the k-th magnitude is looked for among candidates at least a threshold that a
 * strided sample of about 2^14 elements puts at 1.3 k of them (3 k should fewer pass): any
 * threshold that keeps at least k gives the same answer. Otherwise, or should both fail, among all.
 * Returns 0, or -1 where memory ran out. */
int64_t grace_topk(const float *x, int64_t n, int64_t k, void *out, int wide) {
    int64_t *o64 = out;
    int32_t *o32 = out;
    int64_t count = n;
    float threshold = -1.0f; /* every element */
    if (n >= (1 << 15) && k * 8 <= n) {
        int64_t stride = n >> 14, size = (n + stride - 1) / stride;
        float *sample = malloc((size_t)size * sizeof(float));
        if (!sample) return -1;
        for (int64_t i = 0; i < size; i++) sample[i] = magnitude(x[i * stride]);
        const double margins[2] = {1.3, 3.0};
        for (int a = 0; a < 2; a++) {
            int64_t rank = (int64_t)((double)size * (double)k * margins[a] / (double)n);
            if (rank > size - 1) rank = size - 1;
            float t = kth_largest(sample, size, rank);
            if (!(t > 0.0f)) break; /* a lower rank stays at 0: rank them all */
            int64_t c = count_at_least(x, n, t);
            if (c >= k) {
                threshold = t;
                count = c;
                break;
            }
        }
        free(sample);
    }
    /* The candidates' magnitudes, in order, and their indices (where not all are candidates). */
    int all = threshold < 0.0f;
    int64_t *index = all ? NULL : malloc((size_t)count * sizeof(int64_t));
    float *mags = malloc((size_t)count * sizeof(float));
    if ((!all && !index) || !mags) {
        free(index);
        free(mags);
        return -1;
    }
    int64_t c = 0;
    if (all) {
        for (int64_t i = 0; i < n; i++) mags[i] = magnitude(x[i]);
        c = n;
    } else {
        for (int64_t i = 0; i < n; i += SKIP) {
            for (uint32_t mask = mask_at(x, i, n, threshold, 1); mask; mask &= mask - 1) {
                int64_t j = i + __builtin_ctz(mask);
                index[c] = j;
                mags[c++] = magnitude(x[j]);
            }
        }
    }
    float kth = kth_largest_bits(mags, c, k - 1);
    int64_t above = 0;
    for (int64_t j = 0; j < c; j++) above += mags[j] > kth;
    int64_t ties = k - above, w = 0;
    for (int64_t j = 0; j < c && w < k; j++) {
        int take = mags[j] > kth || (mags[j] == kth && ties-- > 0);
        if (take) {
            int64_t at = all ? j : index[j];
            if (wide) o64[w] = at; else o32[w] = (int32_t)at;
            w++;
        }
    }
    free(index);
    free(mags);
    return 0;
}

/* Random-k's choice of m of n elements (grace/rng.py: reference_indices gives the same): draw j picks
 * element (hi * n + (lo * n >> 24)) >> 24 of [0, n), hi and lo being the counter's 24 bits at 2j and
 * 2j + 1 (a 48-bit uniform times n, exact in 64-bit integers); the first m distinct picks are the
 * set, which makes every m-subset equally likely. The set (or, with complement, the n - m elements
 * it leaves out) goes to out ascending, read off a bitmap. Returns 0; -1 without memory; -2 when
 * the counter's 2^32 values run out (n must stay below 2^31). */
int64_t grace_choose(uint32_t k0, uint32_t k1, int64_t n, int64_t m, int complement, void *out,
                     int wide) {
    int64_t words = (n + 63) / 64, count = 0;
    uint64_t *bits = calloc((size_t)(words ? words : 1), sizeof(uint64_t));
    if (!bits) return -1;
    for (uint64_t j = 0; count < m; j++) {
        if (j >= (UINT64_C(1) << 31)) {
            free(bits);
            return -2;
        }
        uint64_t hi = counter_bits((uint32_t)(2 * j), k0, k1);
        uint64_t lo = counter_bits((uint32_t)(2 * j + 1), k0, k1);
        uint64_t v = (hi * (uint64_t)n + ((lo * (uint64_t)n) >> 24)) >> 24;
        uint64_t bit = UINT64_C(1) << (v & 63);
        if (!(bits[v >> 6] & bit)) {
            bits[v >> 6] |= bit;
            count++;
        }
    }
    int64_t *o64 = out;
    int32_t *o32 = out;
    int64_t w = 0;
    for (int64_t i = 0; i < words; i++) {
        uint64_t word = complement ? ~bits[i] : bits[i];
        if (i == words - 1 && n % 64) word &= (UINT64_C(1) << (n % 64)) - 1;
        for (; word; word &= word - 1) {
            int64_t at = i * 64 + __builtin_ctzll(word);
            if (wide) o64[w++] = at; else o32[w++] = (int32_t)at;
        }
    }
    free(bits);
    return 0;
}

/* A bfloat16, given as its bits, widened to float32: it is the top half of one, exactly. */
static inline float widen_bf16(uint16_t b) { return float_of((uint32_t)b << 16); }

/* float32 rounded to bfloat16 bits, to nearest, ties to even, every NaN as the quiet NaN 0x7fc0
 * (TensorFlow's cast and torch's alike). */
static inline uint16_t round_bf16(float v) {
    uint32_t raw;
    memcpy(&raw, &v, sizeof raw);
    return (raw & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u
                                             : (uint16_t)((raw + 0x7fffu + ((raw >> 16) & 1u)) >> 16);
}

/* An IEEE half widened to float32, exactly: 5 exponent bits (bias 15) and 10 of mantissa, its
 * subnormals m * 2^-24 (exact in float32). The portable conversion, where F16C is not built in,
 * and for a range's last elements. */
static inline float widen_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1fu)  /* infinity, or a NaN made quiet (as F16C's conversion and torch's do) */
        return float_of(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u));
    if (exponent == 0) {
        float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/* Elements [start, start + n) of `out` (float32): the 16-bit floats `x` (bfloat16 where `brain`,
 * else IEEE half, as their bits) widened and multiplied by `factor` in float32, in one pass: the
 * bits of a cast and then a product (frameworks/torch/ops.py: scale_into), which take two passes
 * over the float32 tensor. A factor of 1 multiplies nothing (a NaN's payload stays as a cast
 * leaves it). */
void grace_widen_scaled(const uint16_t *x, int32_t brain, float factor, int64_t start, int64_t n,
                        float *out) {
    int64_t i = start, end = start + n;
    int scaled = factor != 1.0f;
    if (brain) {
        for (; i < end; i++) {
            float v = widen_bf16(x[i]);
            out[i] = scaled ? v * factor : v;
        }
        return;
    }
#if defined(__F16C__) && defined(__AVX__)
    __m256 f = _mm256_set1_ps(factor);
    for (; i + 8 <= end; i += 8) {
        __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i)));
        _mm256_storeu_ps(out + i, scaled ? _mm256_mul_ps(v, f) : v);
    }
#endif
    for (; i < end; i++) {
        float v = widen_half(x[i]);
        out[i] = scaled ? v * factor : v;
    }
}

/* Elements [start, start + n) of `out`: float32 `x` as bfloat16 bits (`round_bf16`). One pass,
 * which the compiler vectorises. */
void grace_bf16_round(const float *x, int64_t start, int64_t n, uint16_t *out) {
    for (int64_t i = start; i < start + n; i++) out[i] = round_bf16(x[i]);
}

/* The sum over `workers` rows of bfloat16 bits (rows of `stride` elements, in rank order), in
 * float32, rounded once to bfloat16 to nearest, ties to even, a NaN as the quiet NaN 0x7fc0:
 * elements [start, start + n) of `out`. A bfloat16 is the top half of a float32, so widening is a
 * shift; the composite code (grace/steps.py: bf16_rows_sum) widens, adds row by row and rounds
 * in as many passes over memory. */
void grace_bf16_rows_sum(const uint16_t *rows, int64_t workers, int64_t stride, int64_t start,
                         int64_t n, uint16_t *out) {
    for (int64_t i = start; i < start + n; i++) {
        float sum = widen_bf16(rows[i]);
        for (int64_t r = 1; r < workers; r++) sum += widen_bf16(rows[r * stride + i]);
        out[i] = round_bf16(sum);
    }
}
