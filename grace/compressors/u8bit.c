/* 8-bit quantization's loop (u8bit.py); grace/native/common.h says how it is called. */
#include "common.h"

/* For each element, bin_of(|x| / divisor), plus 128 where x < 0, as a byte. */
void grace_magnitude_bins(const float *x, int64_t start, int64_t n, float divisor,
                          const float *boundaries, const int32_t *low, const int32_t *high,
                          int shift, uint8_t *out) {
    for (int64_t i = start; i < start + n; i++) {
        float relative = fabsf(x[i]) / divisor;
        int32_t index = bin_of(relative, boundaries, low, high, shift);
        out[i] = (uint8_t)(index + (x[i] < 0.0f ? 128 : 0));
    }
}
