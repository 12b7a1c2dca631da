/* SketchML's loop (sketch.py); grace/native/common.h says how it is called. */
#include "common.h"

/* For each element, bin_of(x) as a byte; and per bin the float64 sum and the count of its
 * elements, added into sums and counts (of `bins` each, at most 256). Four partial histograms,
 * element i into histogram i % 4, keep neighbours in one bin from waiting on each other. */
void grace_bin_sums(const float *x, int64_t start, int64_t n, const float *boundaries,
                    const int32_t *low, const int32_t *high, int shift, int32_t bins, uint8_t *ids,
                    double *sums, double *counts) {
    double partial[4][256] = {{0}};
    int64_t tally[4][256] = {{0}};
    for (int64_t i = start; i < start + n; i++) {
        float v = x[i];
        int32_t index = bin_of(v, boundaries, low, high, shift);
        ids[i] = (uint8_t)index;
        partial[i & 3][index] += (double)v;
        tally[i & 3][index] += 1;
    }
    for (int32_t b = 0; b < bins; b++) {
        sums[b] += (partial[0][b] + partial[1][b]) + (partial[2][b] + partial[3][b]);
        counts[b] += (double)(tally[0][b] + tally[1][b] + tally[2][b] + tally[3][b]);
    }
}
