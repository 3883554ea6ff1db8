/* Voxel-grid downsampling through a device hash table keyed by packed voxel cells.
 *
 *   voxel_insert      per point: its cell key goes into the table (atomic compare-and-swap
 *                     on 64-bit keys: needs cl_khr_int64_base_atomics); slot per point
 *   voxel_compact     per table slot: used slots get consecutive output indices
 *   voxel_accumulate  per point: count and channel sums of its voxel (float atomics);
 *                     x y z are summed as offsets from the voxel corner, for precision
 *
 * The float atomics add a voxel's points in whatever order the work-items happen to run,
 * so the sums differ in their last bits from run to run.  The banded strategy (CPUs) sums
 * every voxel's points in their input order instead -- deterministic, and without locked
 * instructions: voxel_point_out gives each point its output voxel, raster.cl's
 * raster_bin_count / raster_bin_offsets (a counting sort by band of output voxels) place
 * the points of each band together in input order (voxel_bin_scatter), and
 * voxel_bin_accumulate (one work-item per band) sums its own voxels.
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

/* Banded strategy, pass 1: every point's output voxel (-1: dropped). */
__kernel void voxel_point_out(const int n, __global const int *restrict slots,
                              __global const int *restrict out_index, __global int *restrict out) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const int slot = slots[i];
    out[i] = slot < 0 ? -1 : out_index[slot];
}

/* Pass 4 (after raster_bin_count and raster_bin_offsets over `out`): every chunk of points
 * (one work-item) writes its points' indices to their band's slots, in input order. */
__kernel void voxel_bin_scatter(const int n, const int chunk, const int band_shift,
                                const int bands, __global const int *restrict out,
                                __global int *restrict hist, __global int *restrict rec_point) {
    const int t = get_global_id(0);
    __global int *offset = hist + (size_t)t * bands;
    const int end = min(n, (t + 1) * chunk);
    for (int i = t * chunk; i < end; ++i) {
        const int o = out[i];
        if (o >= 0) rec_point[offset[o >> band_shift]++] = i;
    }
}

/* Pass 5: every band (one work-item) counts and sums the points of its own voxels. */
__kernel void voxel_bin_accumulate(__global const float *restrict points, const int stride,
                                   const int channels, const float ox, const float oy,
                                   const float oz, const float inv, const float voxel,
                                   const int band_voxels, const int m,
                                   __global const int *restrict band_start,
                                   __global const int *restrict rec_point,
                                   __global const int *restrict out,
                                   __global int *restrict counts, __global float *restrict sums) {
    const int b = get_global_id(0);
    const int lo = b * band_voxels, hi = min(m, lo + band_voxels);
    if (lo >= hi) return;
    for (int o = lo; o < hi; ++o) counts[o] = 0;
    for (size_t k = (size_t)lo * channels; k < (size_t)hi * channels; ++k) sums[k] = 0.0f;
    const int end = band_start[b + 1];
    for (int k = band_start[b]; k < end; ++k) {
        const int i = rec_point[k];
        const int o = out[i];
        const size_t row = (size_t)i * stride;
        const float3 p = (float3)(points[row] - ox, points[row + 1] - oy, points[row + 2] - oz);
        const float3 corner = convert_float3(convert_int3_rtn(p * inv)) * voxel;
        const float3 offset = p - corner;
        __global float *sum = sums + (size_t)o * channels;
        counts[o] += 1;
        sum[0] += offset.x;
        sum[1] += offset.y;
        sum[2] += offset.z;
        for (int c = 3; c < channels; ++c) sum[c] += points[row + c];
    }
}
