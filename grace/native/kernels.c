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

/* A uniform float32 in [0, 1) for element i under key (k0, k1): 24 random bits, exact in float32. */
static inline float counter_uniform(uint32_t i, uint32_t k0, uint32_t k1) {
    uint32_t h = lowbias32(lowbias32(i + k0) ^ k1);
    return (float)(h >> 8) * 0x1p-24f;
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

/* Stochastic rounding to levels, sign-magnitude codes (QSGD; TernGrad with one level): level =
 * (|x| / divisor) * levels; q = floor(level) + (u < level - floor(level)); code = 2 q + (x < 0). */
void grace_quantize_levels(const float *x, int64_t start, int64_t n, float divisor, float levels,
                           uint32_t k0, uint32_t k1, int bits, uint8_t *out) {
    float u[BLOCK];
    uint8_t codes[BLOCK];
    uint8_t mask = (uint8_t)((1U << bits) - 1U);
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const float *p = x + start + b;
        uint32_t first = (uint32_t)(start + b);
        for (int64_t j = 0; j < m; j++) u[j] = counter_uniform(first + (uint32_t)j, k0, k1);
        for (int64_t j = 0; j < m; j++) {
            float v = p[j];
            float level = (fabsf(v) / divisor) * levels;
            float low = floorf(level);
            float q = low + (u[j] < level - low ? 1.0f : 0.0f);
            /* A non-finite level (that step is dropped by the non-finite flag) must not be UB. */
            q = q < 128.0f ? q : 0.0f;
            int32_t code = (int32_t)q * 2 + (v < 0.0f ? 1 : 0);
            codes[j] = (uint8_t)code & mask;
        }
        pack(codes, m, bits, out + (b * bits) / 8);
    }
}

/* One bit per element, 1 where x >= 0; with stats (may be NULL): the count of x >= 0, the float64
 * sum of those elements and the float64 sum of the others. */
void grace_sign_bits(const float *x, int64_t start, int64_t n, uint8_t *out, double *stats) {
    uint8_t codes[BLOCK];
    int64_t count = 0;
    v4d positive = {0}, negative = {0};
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const float *p = x + start + b;
        for (int64_t j = 0; j < m; j++) codes[j] = (uint8_t)(p[j] >= 0.0f);
        if (stats) {
            for (int64_t j = 0; j < m; j++) count += codes[j];
            int64_t whole = m - m % 4;
            for (int64_t j = 0; j < whole; j += 4) {
                v4f f = load4(p + j);
                v4d d = __builtin_convertvector(f, v4d);
                v4l keep = __builtin_convertvector(f >= 0.0f, v4l);
                positive += (v4d)((v4l)d & keep);
                negative += (v4d)((v4l)d & ~keep);
            }
            for (int64_t j = whole; j < m; j++) {
                if (p[j] >= 0.0f) positive[0] += (double)p[j];
                else negative[0] += (double)p[j];
            }
        }
        pack(codes, m, 1, out + b / 8);
    }
    if (stats) {
        stats[0] = (double)count;
        stats[1] = total4(positive);
        stats[2] = total4(negative);
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

/* The indices i in [start, start + n) with |x[i]| >= threshold, written to out (int32), at most cap
 * of them; returns how many there are (more than cap: out holds the first ones). Branch-free: each
 * index is written, and the count moves on only past a candidate. */
int64_t grace_select_above(const float *x, int64_t start, int64_t n, float threshold, int32_t *out,
                           int64_t cap) {
    int64_t count = 0;
    for (int64_t b = start; b < start + n; b += BLOCK) {
        int64_t end = b + BLOCK < start + n ? b + BLOCK : start + n;
        if (count + (end - b) > cap) {
            for (int64_t i = b; i < end; i++) count += fabsf(x[i]) >= threshold;
            continue;
        }
        for (int64_t i = b; i < end; i++) {
            out[count] = (int32_t)i;
            count += fabsf(x[i]) >= threshold;
        }
    }
    return count;
}
