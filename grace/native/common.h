/* What grace's C loops share (grace/native/kernels.c, and a compressor's own loops beside it in
 * grace/compressors/): the counter-based random numbers, bit packing, the bin lookup.
 *
 * Every exported loop works on a range [start, start + n) of elements and takes its arrays' base
 * pointers: it reads and writes at the elements' own positions (a packed output at the byte of its
 * first element), so that Python threads can run disjoint ranges at once (ctypes releases the GIL)
 * and the caller does no pointer arithmetic. A range that packs bits starts at a multiple of 8
 * elements, so it starts on a byte. A loop that selects (writes a variable number of values) counts
 * first, with its outputs NULL, and then writes from the pointers it is given: the caller places
 * each range's selections after those of the ranges before it. */
#ifndef GRACE_COMMON_H
#define GRACE_COMMON_H
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

/* Codes of `bits` bits for `count` elements packed into out, which starts on a byte. The widths that
 * divide 8 have a loop each, with the codes per byte a constant, so that it vectorises. */
#define PACK_WHOLE(PER, BITS)                                                                    \
    for (int64_t b = 0; b < count / (PER); b++) {                                                \
        uint8_t byte = 0;                                                                        \
        for (int j = 0; j < (PER); j++) byte |= (uint8_t)(codes[b * (PER) + j] << ((BITS) * j)); \
        out[b] = byte;                                                                           \
    }

static inline void pack(const uint8_t *codes, int64_t count, int bits, uint8_t *out) {
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

/* draw_uniform: n uniform float32 draws for elements [start, start + n) into out[0 .. n). */
static inline void draw_uniform(uint32_t k0, uint32_t k1, int64_t start, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = counter_uniform((uint32_t)(start + i), k0, k1);
}

/* Counting the ascending boundaries <= v fast: a float's top bits (sign, exponent, a few bits of
 * mantissa: the top 32 - shift bits) fix an interval of values, and the count for any v in it lies
 * in [low[key], high[key]], which the caller computed once. Most intervals hold no boundary or one,
 * so one compare decides; a loop takes the rare wider interval, exactly. */
static inline int32_t bin_of(float v, const float *boundaries, const int32_t *low, const int32_t *high,
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

#endif
