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
#include <math.h>
#include <stdint.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define BLOCK 1024

/* Four float64 running sums, element i into sum i % 4: the order is fixed, and the loop runs on
 * vector registers (GCC's and Clang's vector extensions). */
typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef int64_t v4l __attribute__((vector_size(32)));

static inline v4f load4(const float *p) {
    v4f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline double total4(v4d v) { return (v[0] + v[1]) + (v[2] + v[3]); }

/* Chris Wellons's "lowbias32" integer hash. */
static inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* The counter's 24 random bits for element i under key (k0, k1) (grace/rng.py: counter_uniform_bits). */
static inline uint32_t counter_bits(uint32_t i, uint32_t k0, uint32_t k1) {
    return lowbias32(lowbias32(i + k0) ^ k1) >> 8;
}

/* A uniform float32 in [0, 1) for element i: its 24 bits, exact in float32. */
static inline float counter_uniform(uint32_t i, uint32_t k0, uint32_t k1) {
    return (float)counter_bits(i, k0, k1) * 0x1p-24f;
}

void grace_uniform(uint32_t k0, uint32_t k1, int64_t start, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = counter_uniform((uint32_t)(start + i), k0, k1);
}

/* Codes of `bits` bits for `count` elements packed into out, which starts on a byte. The widths that
 * divide 8 have a loop each, with the codes per byte a constant, so that it vectorises. */
#define PACK_WHOLE(PER, BITS)                                                                    \
    for (int64_t b = 0; b < count / (PER); b++) {                                                \
        uint8_t byte = 0;                                                                        \
        for (int j = 0; j < (PER); j++) byte |= (uint8_t)(codes[b * (PER) + j] << ((BITS) * j)); \
        out[b] = byte;                                                                           \
    }

static void pack(const uint8_t *codes, int64_t count, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, codes, (size_t)count);
    } else if (8 % bits == 0) {
        int per = 8 / bits;
        int64_t whole = count / per;
        if (bits == 1) {
            PACK_WHOLE(8, 1)
        } else if (bits == 2) {
            PACK_WHOLE(4, 2)
        } else {
            PACK_WHOLE(2, 4)
        }
        if (count % per) {
            uint8_t byte = 0;
            for (int64_t j = 0; j < count % per; j++) byte |= (uint8_t)(codes[whole * per + j] << (bits * j));
            out[whole] = byte;
        }
    } else {
        uint64_t acc = 0;
        int filled = 0;
        int64_t o = 0;
        for (int64_t i = 0; i < count; i++) {
            acc |= (uint64_t)codes[i] << filled;
            filled += bits;
            while (filled >= 8) {
                out[o++] = (uint8_t)acc;
                acc >>= 8;
                filled -= 8;
            }
        }
        if (filled) out[o] = (uint8_t)acc;
    }
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
    int64_t bucket = start / block, left = block - start % block;  /* elements left in it */
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const float *p = x + start + b;
        grace_uniform(k0, k1, start + b, m, u);
        for (int64_t j = 0; j < m; j++) {
            if (left == 0) {
                bucket++;
                left = block;
            }
            left--;
            float v = p[j];
            float level = (fabsf(v) / divisors[bucket]) * levels;
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
 * small table per block (a scale per bucket). bits divides 8. With base (else NULL), base[i] plus
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

/* Natural compression: |x| rounded at random to a power of two around it (grace/compressors/
 * natural.py): the exponent field of the result (0 for zero, at most 254) as a byte, and a bit per
 * element, 1 where x < 0, packed. */
void grace_natural_encode(const float *x, int64_t start, int64_t n, uint32_t k0, uint32_t k1,
                          uint8_t *codes, uint8_t *signs) {
    uint8_t negative[BLOCK];
    float u[BLOCK];
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const float *p = x + start + b;
        grace_uniform(k0, k1, start + b, m, u);
        for (int64_t j = 0; j < m; j++) {
            float magnitude = fabsf(p[j]);
            uint32_t raw;
            memcpy(&raw, &magnitude, sizeof raw);
            int32_t exponent = (int32_t)((raw >> 23) & 0xFF);
            int32_t floor_exponent = exponent > 1 ? exponent : 1;
            uint32_t low_bits = (uint32_t)floor_exponent << 23;
            float low;
            memcpy(&low, &low_bits, sizeof low);
            float excess = exponent >= 1 ? magnitude - low : magnitude;
            int32_t up = u[j] < excess / low ? 1 : 0;
            int32_t code = exponent >= 1 ? exponent + up : up;
            code = code < 254 ? code : 254;
            codes[start + b + j] = (uint8_t)code;
            negative[j] = (uint8_t)(p[j] < 0.0f);
        }
        pack(negative, m, 1, signs + b / 8);
    }
}

/* The inverse: the power of two of each exponent byte (0 stays 0), negated where the sign bit is 1. */
void grace_natural_decode(const uint8_t *codes, const uint8_t *signs, int64_t start, int64_t n,
                          float *out) {
    float magnitude[256];
    magnitude[0] = 0.0f;
    for (uint32_t c = 1; c < 256; c++) {
        uint32_t raw = c << 23;
        memcpy(&magnitude[c], &raw, sizeof(float));
    }
    for (int64_t i = start; i < start + n; i++) {
        float sign = 1.0f - 2.0f * (float)((signs[i / 8] >> (i % 8)) & 1);
        out[i] = magnitude[codes[i]] * sign;
    }
}

/* Counting the ascending boundaries <= v fast: a float's top bits (sign, exponent, a few bits of
 * mantissa: the top 32 - shift bits) fix an interval of values, and the count for any v in it lies
 * in [low[key], high[key]], which the caller computed once. Most intervals hold no boundary or one,
 * so one compare decides; a loop takes the rare wider interval, exactly. */
static inline int32_t bucket_of(float v, const float *boundaries, const int32_t *low, const int32_t *high,
                                int shift) {
    uint32_t raw;
    memcpy(&raw, &v, sizeof raw);
    uint32_t key = raw >> shift;
    int32_t index = low[key], end = high[key];
    if (__builtin_expect(end - index > 1, 0)) {
        while (index < end && boundaries[index] <= v) index++;
        return index;
    }
    return index + (int32_t)(index < end && boundaries[index] <= v);
}

/* For each element, bucket_of(|x| / divisor), plus 128 where x < 0, as a byte. */
void grace_magnitude_buckets(const float *x, int64_t start, int64_t n, float divisor,
                             const float *boundaries, const int32_t *low, const int32_t *high,
                             int shift, uint8_t *out) {
    for (int64_t i = start; i < start + n; i++) {
        float relative = fabsf(x[i]) / divisor;
        int32_t index = bucket_of(relative, boundaries, low, high, shift);
        out[i] = (uint8_t)(index + (x[i] < 0.0f ? 128 : 0));
    }
}

/* For each element, bucket_of(x) as a byte; and per bucket the float64 sum and the count of its
 * elements, added into sums and counts (of `buckets` each, at most 256). Four partial histograms,
 * element i into histogram i % 4, keep neighbours in one bucket from waiting on each other. */
void grace_bucketize_sums(const float *x, int64_t start, int64_t n, const float *boundaries,
                          const int32_t *low, const int32_t *high, int shift, int32_t buckets, uint8_t *ids,
                          double *sums, double *counts) {
    double partial[4][256] = {{0}};
    int64_t tally[4][256] = {{0}};
    for (int64_t i = start; i < start + n; i++) {
        float v = x[i];
        int32_t index = bucket_of(v, boundaries, low, high, shift);
        ids[i] = (uint8_t)index;
        partial[i & 3][index] += (double)v;
        tally[i & 3][index] += 1;
    }
    for (int32_t b = 0; b < buckets; b++) {
        sums[b] += (partial[0][b] + partial[1][b]) + (partial[2][b] + partial[3][b]);
        counts[b] += (double)(tally[0][b] + tally[1][b] + tally[2][b] + tally[3][b]);
    }
}

/* AdaQ's selection (grace/compressors/adaq.py) over [start, start + n): the elements with
 * x >= top and x > 0, and those with x <= bottom and x < 0. With out_high/out_low NULL it only
 * counts them (into counts[0], counts[1]); else it writes their indices (int64, each list with a
 * slot of slack), branch-free. */
void grace_two_sided(const float *x, int64_t start, int64_t n, float top, float bottom, int64_t *out_high,
                     int64_t *out_low, int64_t *counts) {
    int64_t high = 0, low = 0;
    if (out_high) {
        for (int64_t i = start; i < start + n; i++) {
            float v = x[i];
            out_high[high] = i;
            out_low[low] = i;
            high += (v >= top) & (v > 0.0f);
            low += (v <= bottom) & (v < 0.0f);
        }
    } else {
        for (int64_t i = start; i < start + n; i++) {
            float v = x[i];
            high += (v >= top) & (v > 0.0f);
            low += (v <= bottom) & (v < 0.0f);
        }
    }
    counts[0] = high;
    counts[1] = low;
}

/* INCEPTIONN's 2-bit tags, four to a byte. A block's members are moved four elements at a time, to
 * or from one array of the block laid out [class 0 slot | class 1 | class 2 | class 3], with no
 * branch on a class (the classes interleave at random) and one store per element. The next free
 * position of each class in that array is kept in one 64-bit word, 16 bits a class (a block has
 * at most BLOCK + 1 positions), so that it stays in a register. For each byte value: for each lane,
 * the shift that picks its class's position and its rank among the byte's lanes of its class (0
 * for class 0, whose lanes all go to its one slot); and what the byte adds to the positions. */
static struct {
    uint8_t lane_shift[256][4];
    uint8_t lane_rank[256][4];
    uint64_t step[256];
} tag_table;

__attribute__((constructor)) static void tag_table_init(void) {
    for (int v = 0; v < 256; v++) {
        int lanes[4] = {0, 0, 0, 0};
        for (int k = 0; k < 4; k++) {
            int c = (v >> (2 * k)) & 3;
            tag_table.lane_shift[v][k] = (uint8_t)(16 * c);
            tag_table.lane_rank[v][k] = (uint8_t)(c ? lanes[c] : 0);
            lanes[c] += c != 0;
        }
        tag_table.step[v] = (uint64_t)lanes[1] << 16 | (uint64_t)lanes[2] << 32 | (uint64_t)lanes[3] << 48;
    }
}

/* The position in the block's array of lane k of tag byte v, given the classes' next positions. */
static inline int32_t lane_position(uint64_t next, uint8_t v, int k) {
    return (int32_t)((next >> tag_table.lane_shift[v][k]) & 0xFFFFU) + tag_table.lane_rank[v][k];
}

static inline uint64_t first_positions(int32_t k1, int32_t k2) {
    return (uint64_t)1 << 16 | (uint64_t)(1 + k1) << 32 | (uint64_t)(1 + k1 + k2) << 48;
}

/* The tag byte of elements [4 i, 4 i + 4) of a block of m, lanes past m read as class 0. */
static inline uint8_t tag_byte(const uint8_t *tags, int64_t i, int64_t m) {
    int64_t valid = m - 4 * i;
    return valid >= 4 ? tags[i] : (uint8_t)(tags[i] & ((1U << (2 * valid)) - 1U));
}

/* How many of the tags of a block of m <= BLOCK elements are 1, 2 and 3, into k[0], k[1], k[2]: the
 * bytes' steps added up (a block's counts fit their 16 bits). */
static inline void block_counts(const uint8_t *tags, int64_t m, int32_t k[3]) {
    uint64_t lanes = 0;
    for (int64_t i = 0; i < (m + 3) / 4; i++) lanes += tag_table.step[tag_byte(tags, i, m)];
    k[0] = (int32_t)(lanes >> 16 & 0xFFFFU);
    k[1] = (int32_t)(lanes >> 32 & 0xFFFFU);
    k[2] = (int32_t)(lanes >> 48);
}

/* INCEPTIONN (grace/compressors/inceptionn.py): steps = rint(x * inverse); a 2-bit tag per element,
 * 0 where |steps| < 1, 1 below 128, 2 below 32768, else 3. With counts only (tags NULL) it counts
 * the tags 1, 2, 3 of [start, start + n); else it packs the tags (tags starts on this range's byte)
 * and writes the class members: steps as int8, steps as int16, x itself. */
void grace_inceptionn_encode(const float *x, int64_t start, int64_t n, float inverse, uint8_t *tags,
                             int8_t *small, int16_t *medium, float *large, int64_t *counts) {
    uint8_t codes[BLOCK];
    float steps[BLOCK];
    int32_t word[BLOCK], members[BLOCK + 1];
    int64_t c1 = 0, c2 = 0, c3 = 0;
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const float *p = x + start + b;
        /* Loops of one kind of work each, so that each is vectorised. */
        for (int64_t j = 0; j < m; j++) steps[j] = rintf(p[j] * inverse);
        for (int64_t j = 0; j < m; j++) {
            float size = fabsf(steps[j]);
            codes[j] = (uint8_t)((size >= 1.0f) + (size >= 128.0f) + (size >= 32768.0f));
        }
        int32_t k1 = 0, k2 = 0, k3 = 0;
        for (int64_t j = 0; j < m; j++) {
            k1 += codes[j] == 1;
            k2 += codes[j] == 2;
            k3 += codes[j] == 3;
        }
        if (tags) {
            uint8_t *t = tags + b / 4;
            pack(codes, m, 2, t);
            /* Each element as a 32-bit word: its steps (clamped, NaN made 0, since the conversion is
             * undefined out of range; only the members of classes 1 and 2 send them, and they fit),
             * or for class 3 its float's bits. */
            for (int64_t j = 0; j < m; j++) {
                float clamped = steps[j] < -32768.0f ? -32768.0f : steps[j];
                clamped = clamped > 32767.0f ? 32767.0f : clamped;
                int32_t whole = (int32_t)(steps[j] == steps[j] ? clamped : 0.0f);
                int32_t bits;
                memcpy(&bits, p + j, sizeof bits);
                word[j] = codes[j] == 3 ? bits : whole;
            }
            uint64_t next = first_positions(k1, k2);
            for (int64_t i = 0; i < (m + 3) / 4; i++) {
                uint8_t v = tag_byte(t, i, m);
                if (4 * i + 4 <= m) {
                    members[lane_position(next, v, 0)] = word[4 * i];
                    members[lane_position(next, v, 1)] = word[4 * i + 1];
                    members[lane_position(next, v, 2)] = word[4 * i + 2];
                    members[lane_position(next, v, 3)] = word[4 * i + 3];
                } else {
                    for (int k = 0; 4 * i + k < m; k++) members[lane_position(next, v, k)] = word[4 * i + k];
                }
                next += tag_table.step[v];
            }
            for (int32_t j = 0; j < k1; j++) small[c1 + j] = (int8_t)members[1 + j];
            for (int32_t j = 0; j < k2; j++) medium[c2 + j] = (int16_t)members[1 + k1 + j];
            memcpy(large + c3, members + 1 + k1 + k2, sizeof(float) * (size_t)k3);
        }
        c1 += k1;
        c2 += k2;
        c3 += k3;
    }
    counts[0] = c1;
    counts[1] = c2;
    counts[2] = c3;
}

/* How many of the 2-bit tags of elements [start, start + n) are 1, 2 and 3 (start a multiple of 4),
 * block by block. */
void grace_count_tags(const uint8_t *tags, int64_t start, int64_t n, int64_t *counts) {
    int64_t c1 = 0, c2 = 0, c3 = 0;
    for (int64_t b = 0; b < n; b += BLOCK) {
        int32_t k[3];
        block_counts(tags + (start + b) / 4, n - b < BLOCK ? n - b : BLOCK, k);
        c1 += k[0];
        c2 += k[1];
        c3 += k[2];
    }
    counts[0] = c1;
    counts[1] = c2;
    counts[2] = c3;
}

/* The inverse, for elements [start, start + n) (start a multiple of 4), whose first members of each
 * class are small[c1], medium[c2], large[c3]; the caller has checked that the tags and the members
 * agree in number. Block by block: the block's members are decoded (steps times error_bound, or the
 * float itself) into one array laid out as tag_table says, behind a zero for class 0, and each
 * element takes its value from there. */
void grace_inceptionn_decode(const uint8_t *tags, int64_t start, int64_t n, const int8_t *small,
                             const int16_t *medium, const float *large, int64_t c1, int64_t c2,
                             int64_t c3, float error_bound, float *out) {
    float values[BLOCK + 1];
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const uint8_t *t = tags + (start + b) / 4;
        int32_t k[3];
        block_counts(t, m, k);
        int32_t k1 = k[0], k2 = k[1], k3 = k[2];
        values[0] = 0.0f;
        for (int32_t j = 0; j < k1; j++) values[1 + j] = (float)small[c1 + j] * error_bound;
        for (int32_t j = 0; j < k2; j++) values[1 + k1 + j] = (float)medium[c2 + j] * error_bound;
        memcpy(values + 1 + k1 + k2, large + c3, sizeof(float) * (size_t)k3);
        uint64_t next = first_positions(k1, k2);
        float *o = out + start + b;
        for (int64_t i = 0; i < (m + 3) / 4; i++) {
            uint8_t v = tag_byte(t, i, m);
            if (4 * i + 4 <= m) {
                o[4 * i] = values[lane_position(next, v, 0)];
                o[4 * i + 1] = values[lane_position(next, v, 1)];
                o[4 * i + 2] = values[lane_position(next, v, 2)];
                o[4 * i + 3] = values[lane_position(next, v, 3)];
            } else {
                for (int k = 0; 4 * i + k < m; k++) o[4 * i + k] = values[lane_position(next, v, k)];
            }
            next += tag_table.step[v];
        }
        c1 += k1;
        c2 += k2;
        c3 += k3;
    }
}

static inline float float_of(uint32_t raw) {
    float v;
    memcpy(&v, &raw, sizeof v);
    return v;
}

/* The index bucket_of reads, for `count` ascending boundaries and keys of 32 - shift bits: for each
 * key, how many boundaries are <= the lowest and the highest float with those top bits (0 and 0 for
 * NaN keys). The positive keys grow in value with the key and the negative ones shrink, so each half
 * is one sweep with two pointers that only move forward. */
void grace_bucket_index(const float *boundaries, int32_t count, int shift, int32_t *low, int32_t *high) {
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
