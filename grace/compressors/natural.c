/* Natural compression's loops (natural.py); grace/native/common.h says how they are called. */
#include "common.h"

/* Natural compression: |x| rounded at random to a power of two around it (grace/compressors/
 * natural.py): the exponent field of the result (0 for zero, at most 254) as a byte, and a bit per
 * element, 1 where x < 0, packed. */
void grace_natural_encode(const float *x, int64_t start, int64_t n, uint32_t k0, uint32_t k1,
                          uint8_t *codes, uint8_t *signs) {
    uint8_t negative[BLOCK];
    float u[BLOCK];
    signs += start / 8;  /* this range's first byte */
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const float *p = x + start + b;
        draw_uniform(k0, k1, start + b, m, u);
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
