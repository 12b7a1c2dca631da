/* INCEPTIONN's loops (inceptionn.py); grace/native/common.h says how they are called. */
#include "common.h"

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
 * the tags 1, 2, 3 of [start, start + n); else it packs the tags (at its elements' bytes)
 * and writes the class members: steps as int8, steps as int16, x itself. */
void grace_inceptionn_encode(const float *x, int64_t start, int64_t n, float inverse, uint8_t *tags,
                             int8_t *small, int16_t *medium, float *large, int64_t *counts) {
    uint8_t codes[BLOCK];
    float steps[BLOCK];
    int32_t word[BLOCK], members[BLOCK + 1];
    int64_t c1 = 0, c2 = 0, c3 = 0;
    if (tags) tags += start / 4;  /* this range's first byte */
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
