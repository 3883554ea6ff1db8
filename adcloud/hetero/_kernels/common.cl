/* Shared helpers of adcloud's OpenCL kernels (OpenCL C 1.2).
 *
 * Prepended to every program.  Cell keys pack three signed cell indices of 21 bits
 * each (offset by 2^20) into one 64-bit key; EMPTY_KEY marks a free hash-table slot and
 * can never be a packed key (bit 63 is never set by packing).
 */

#define KEY_BITS 21
#define KEY_OFFSET (1 << 20)
#define KEY_MASK ((1UL << KEY_BITS) - 1UL)
#define EMPTY_KEY (~0UL)
#define HASH_MULT 0x9E3779B97F4A7C15UL

/* Whether a cell index fits in the 21-bit signed range of a packed key. */
inline bool cell_in_range(int3 c) {
    return c.x >= -KEY_OFFSET && c.x < KEY_OFFSET && c.y >= -KEY_OFFSET && c.y < KEY_OFFSET
        && c.z >= -KEY_OFFSET && c.z < KEY_OFFSET;
}

inline ulong pack_key(int3 c) {
    return ((ulong)(c.x + KEY_OFFSET) & KEY_MASK)
         | (((ulong)(c.y + KEY_OFFSET) & KEY_MASK) << KEY_BITS)
         | (((ulong)(c.z + KEY_OFFSET) & KEY_MASK) << (2 * KEY_BITS));
}

/* Slot of a key in a table of 2^(64 - shift) slots (Fibonacci hashing). */
inline uint hash_slot(ulong key, uint shift) {
    return (uint)((key * HASH_MULT) >> shift);
}

/* Cell of a point whose coordinates are already divided by the cell size; false when the
 * point is not finite or its cell does not fit in a packed key. */
inline bool cell_of(float3 scaled, int3 *cell) {
    if (!(isfinite(scaled.x) && isfinite(scaled.y) && isfinite(scaled.z))) return false;
    const float limit = (float)KEY_OFFSET;
    if (!(fabs(scaled.x) < limit && fabs(scaled.y) < limit && fabs(scaled.z) < limit)) return false;
    *cell = convert_int3_rtn(scaled);
    return cell_in_range(*cell);
}

/* Value stored for `key` in a linear-probing table, or -1 when absent. */
inline int table_find(__global const ulong *restrict keys, __global const int *restrict values,
                      uint mask, uint shift, ulong key) {
    uint slot = hash_slot(key, shift);
    for (uint probe = 0; probe <= mask; ++probe) {
        const ulong found = keys[slot];
        if (found == key) return values[slot];
        if (found == EMPTY_KEY) return -1;
        slot = (slot + 1) & mask;
    }
    return -1;
}

/* Float atomics from 32-bit integer atomics (core OpenCL 1.1+). */
inline void atomic_add_float(volatile __global float *addr, float value) {
    union { uint u; float f; } expected, desired;
    expected.f = *addr;
    for (;;) {
        desired.f = expected.f + value;
        const uint seen = atomic_cmpxchg((volatile __global uint *)addr, expected.u, desired.u);
        if (seen == expected.u) return;
        expected.u = seen;
    }
}

/* min/max on IEEE floats through the integer order of their bit patterns: non-negative
 * floats order like signed ints, negative ones reversed like unsigned ints.  -0 is folded
 * into +0 first.  A cheap read skips the atomic when the value cannot win. */
inline void atomic_min_float(volatile __global float *addr, float value) {
    if (!(value < *addr)) return;
    if (value == 0.0f) value = 0.0f;
    if (value >= 0.0f) atomic_min((volatile __global int *)addr, as_int(value));
    else atomic_max((volatile __global uint *)addr, as_uint(value));
}

inline void atomic_max_float(volatile __global float *addr, float value) {
    if (!(value > *addr)) return;
    if (value == 0.0f) value = 0.0f;
    if (value >= 0.0f) atomic_max((volatile __global int *)addr, as_int(value));
    else atomic_min((volatile __global uint *)addr, as_uint(value));
}
