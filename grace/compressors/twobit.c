/* Two-bit quantization's loop (twobit.py); grace/native/common.h says how they are called. */
#include "common.h"

/* Each element of float32 x against its block's threshold t (blocks of `block` elements): 3
 * (binary 11) at or above t, 2 (10) at or below -t where x < 0, else 0 (a NaN too); packed four
 * to a byte, the first element in the lowest bits, as Ops.pack_bits(codes, 2). */
void grace_twobit_codes(const float *x, int64_t start, int64_t n, const float *thresholds,
                        int64_t block, uint8_t *out) {
    uint8_t codes[BLOCK];
    out += start / 4;  /* this range's first byte: ranges start on multiples of 1024 */
    int64_t index = start / block, left = block - start % block;  /* elements left in the block */
    float t = thresholds[index];
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t m = n - b < BLOCK ? n - b : BLOCK;
        const float *p = x + start + b;
        for (int64_t j = 0; j < m; j++) {
            if (left == 0) {
                t = thresholds[++index];
                left = block;
            }
            left--;
            float v = p[j];
            codes[j] = v >= t ? 3 : (-v >= t && v < 0.0f ? 2 : 0);
        }
        pack(codes, m, 2, out + b / 4);
    }
}
