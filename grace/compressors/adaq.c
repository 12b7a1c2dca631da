/* AdaQ's loop (adaq.py); grace/native/common.h says how it is called. */
#include "common.h"

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
