/* Voxel-grid downsampling through a device hash table keyed by packed voxel cells.
 *
 *   voxel_insert      per point: its cell key goes into the table (atomic compare-and-swap
 *                     on 64-bit keys: needs cl_khr_int64_base_atomics); slot per point
 *   voxel_compact     per table slot: used slots get consecutive output indices
 *   voxel_accumulate  per point: count and channel sums of its voxel (float atomics);
 *                     x y z are summed as offsets from the voxel corner, for precision
 *
 * Coordinates arrive relative to a host-chosen origin on the voxel lattice; `inv` is
 * 1 / voxel size.  Points whose xyz is not finite get slot -1; points whose cell does not
 * fit in a packed key are counted in `overflow` (the host raises).
 */
#pragma OPENCL EXTENSION cl_khr_int64_base_atomics : enable

__kernel void voxel_insert(__global const float *restrict points, const int stride, const int n,
                           const float ox, const float oy, const float oz, const float inv,
                           __global ulong *keys, const uint mask, const uint shift,
                           __global int *restrict slots, volatile __global int *overflow) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const size_t row = (size_t)i * stride;
    const float3 p = (float3)(points[row] - ox, points[row + 1] - oy, points[row + 2] - oz);
    if (!(isfinite(p.x) && isfinite(p.y) && isfinite(p.z))) { slots[i] = -1; return; }
    int3 cell;
    if (!cell_of(p * inv, &cell)) { slots[i] = -1; atomic_inc(overflow); return; }
    const ulong key = pack_key(cell);
    uint slot = hash_slot(key, shift);
    for (;;) {
        const ulong seen = keys[slot];
        if (seen == key) break;
        if (seen == EMPTY_KEY) {
            const ulong prev = atom_cmpxchg((volatile __global ulong *)&keys[slot], EMPTY_KEY, key);
            if (prev == EMPTY_KEY || prev == key) break;
        }
        slot = (slot + 1) & mask;
    }
    slots[i] = (int)slot;
}

__kernel void voxel_compact(__global const ulong *restrict keys, const uint size,
                            __global int *restrict out_index, __global ulong *restrict out_keys,
                            volatile __global int *n_out) {
    const uint slot = get_global_id(0);
    if (slot >= size) return;
    const ulong key = keys[slot];
    if (key == EMPTY_KEY) return;
    const int o = atomic_inc(n_out);
    out_index[slot] = o;
    out_keys[o] = key;
}

__kernel void voxel_accumulate(__global const float *restrict points, const int stride,
                               const int n, const int channels,
                               const float ox, const float oy, const float oz,
                               const float inv, const float voxel,
                               __global const int *restrict slots,
                               __global const int *restrict out_index,
                               volatile __global int *counts, volatile __global float *sums) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const int slot = slots[i];
    if (slot < 0) return;
    const int o = out_index[slot];
    const size_t row = (size_t)i * stride;
    const float3 p = (float3)(points[row] - ox, points[row + 1] - oy, points[row + 2] - oz);
    const float3 corner = convert_float3(convert_int3_rtn(p * inv)) * voxel;
    const float3 offset = p - corner;
    atomic_inc(&counts[o]);
    volatile __global float *sum = sums + (size_t)o * channels;
    atomic_add_float(&sum[0], offset.x);
    atomic_add_float(&sum[1], offset.y);
    atomic_add_float(&sum[2], offset.z);
    for (int c = 3; c < channels; ++c) atomic_add_float(&sum[c], points[row + c]);
}
