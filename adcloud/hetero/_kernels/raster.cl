/* Rasterization of points into a 2-D grid: count, mean/min/max height, mean intensity.
 *
 * Point i is (x, y, z) = points[i*stride + 0..2], its intensity
 * values[i*vstride + voffset] when `with_values`.  Its cell is
 * (floor((y - oy) * inv), floor((x - ox) * inv)) in a height x width grid, row-major;
 * points outside the grid or with a non-finite x, y, z (or intensity, when used) are
 * skipped.
 *
 * Two strategies produce the same statistics:
 *   atomic  raster_atomic: one work-item per point updating per-cell arrays with atomics
 *           (atomic_inc, float add by compare-and-swap, float min/max through integer
 *           atomics); for GPUs, whose thousands of threads hide the atomics' latency.
 *   banded  raster_cells + raster_bands: each work-item owns a band of cells and walks the
 *           precomputed cell of every point, updating only its own cells without atomics;
 *           for CPUs, where locked instructions serialise memory traffic.  Deterministic.
 * Empty cells get count 0 and NaN layers.
 */

inline int point_cell(__global const float *restrict points, int stride, int i,
                      __global const float *restrict values, int vstride, int voffset,
                      int with_values, float ox, float oy, float inv, int width, int height,
                      float *z, float *v) {
    const size_t row = (size_t)i * stride;
    const float fx = (points[row] - ox) * inv;
    const float fy = (points[row + 1] - oy) * inv;
    *z = points[row + 2];
    *v = with_values ? values[(size_t)i * vstride + voffset] : 0.0f;
    if (!(fx >= 0.0f && fx < (float)width && fy >= 0.0f && fy < (float)height)) return -1;
    if (!isfinite(*z) || !isfinite(*v)) return -1;
    return (int)fy * width + (int)fx;
}

__kernel void raster_atomic(__global const float *restrict points, const int stride, const int n,
                            __global const float *restrict values, const int vstride,
                            const int voffset, const int with_values,
                            const float ox, const float oy, const float inv,
                            const int width, const int height,
                            volatile __global int *count, volatile __global float *sum_z,
                            volatile __global float *sum_v, volatile __global float *min_z,
                            volatile __global float *max_z) {
    const int i = get_global_id(0);
    if (i >= n) return;
    float z, v;
    const int c = point_cell(points, stride, i, values, vstride, voffset, with_values,
                             ox, oy, inv, width, height, &z, &v);
    if (c < 0) return;
    atomic_inc(&count[c]);
    atomic_add_float(&sum_z[c], z);
    if (with_values) atomic_add_float(&sum_v[c], v);
    atomic_min_float(&min_z[c], z);
    atomic_max_float(&max_z[c], z);
}

__kernel void raster_finalize_atomic(const int cells, __global const int *restrict count,
                                     __global const float *restrict sum_z,
                                     __global const float *restrict sum_v,
                                     __global float *restrict min_z,
                                     __global float *restrict max_z,
                                     __global float *restrict mean_z,
                                     __global float *restrict mean_v) {
    const int c = get_global_id(0);
    if (c >= cells) return;
    const int k = count[c];
    const float inv_k = k ? 1.0f / (float)k : NAN;
    mean_z[c] = sum_z[c] * inv_k;
    mean_v[c] = sum_v[c] * inv_k;
    if (!k) { min_z[c] = NAN; max_z[c] = NAN; }
}

/* Binned strategy, pass 1: the cell of every point (-1: skipped), one work-item per point
 * so that PoCL vectorises the arithmetic. */
__kernel void raster_cells(__global const float *restrict points, const int stride, const int n,
                           __global const float *restrict values, const int vstride,
                           const int voffset, const int with_values,
                           const float ox, const float oy, const float inv,
                           const int width, const int height, __global int *restrict cell) {
    const int i = get_global_id(0);
    if (i >= n) return;
    float z, v;
    cell[i] = point_cell(points, stride, i, values, vstride, voffset, with_values,
                         ox, oy, inv, width, height, &z, &v);
}

/* Pass 2: every chunk of points (one work-item each) counts its points per band (a band is
 * 2^band_shift consecutive cells). */
__kernel void raster_bin_count(const int n, const int chunk, const int band_shift,
                               const int bands, __global const int *restrict cell,
                               __global int *restrict hist) {
    const int t = get_global_id(0);
    __global int *h = hist + (size_t)t * bands;
    for (int b = 0; b < bands; ++b) h[b] = 0;
    const int end = min(n, (t + 1) * chunk);
    for (int i = t * chunk; i < end; ++i) {
        const int c = cell[i];
        if (c >= 0) ++h[c >> band_shift];
    }
}

/* Pass 3 (one work-item): exclusive prefix sums, band-major then chunk order, so that each
 * band's points end up contiguous and in their original order. */
__kernel void raster_bin_offsets(const int chunks, const int bands,
                                 __global int *restrict hist, __global int *restrict band_start) {
    int total = 0;
    for (int b = 0; b < bands; ++b) {
        band_start[b] = total;
        for (int t = 0; t < chunks; ++t) {
            const int k = hist[(size_t)t * bands + b];
            hist[(size_t)t * bands + b] = total;
            total += k;
        }
    }
    band_start[bands] = total;
}

/* Pass 4: every chunk writes (cell, z, intensity) of its points to their band's slots. */
__kernel void raster_bin_scatter(__global const float *restrict points, const int stride,
                                 const int n, __global const float *restrict values,
                                 const int vstride, const int voffset, const int with_values,
                                 const int chunk, const int band_shift, const int bands,
                                 __global const int *restrict cell, __global int *restrict hist,
                                 __global int *restrict rec_cell, __global float2 *restrict rec) {
    const int t = get_global_id(0);
    __global int *offset = hist + (size_t)t * bands;
    const int end = min(n, (t + 1) * chunk);
    for (int i = t * chunk; i < end; ++i) {
        const int c = cell[i];
        if (c < 0) continue;
        const int k = offset[c >> band_shift]++;
        rec_cell[k] = c;
        rec[k] = (float2)(points[(size_t)i * stride + 2],
                          with_values ? values[(size_t)i * vstride + voffset] : 0.0f);
    }
}

/* Pass 5: every band (one work-item) accumulates its own points into its own cells in
 * local memory -- no atomics, and the accumulators (count, sum z, sum intensity, min z,
 * max z: five arrays of band_cells floats) stay in cache -- then writes the band's output
 * layers. */
__kernel void raster_bin_accumulate(const int band_cells, const int cells,
                                    __global const int *restrict band_start,
                                    __global const int *restrict rec_cell,
                                    __global const float2 *restrict rec,
                                    __local float *acc,
                                    __global int *restrict count,
                                    __global float *restrict mean_z,
                                    __global float *restrict min_z,
                                    __global float *restrict max_z,
                                    __global float *restrict mean_v) {
    const int b = get_group_id(0);
    const int lo = b * band_cells, hi = min(cells, lo + band_cells), span = hi - lo;
    __local float *n = acc;
    __local float *sz = acc + band_cells;
    __local float *sv = acc + 2 * band_cells;
    __local float *lo_z = acc + 3 * band_cells;
    __local float *hi_z = acc + 4 * band_cells;
    for (int c = 0; c < span; ++c) {
        n[c] = 0.0f; sz[c] = 0.0f; sv[c] = 0.0f; lo_z[c] = INFINITY; hi_z[c] = -INFINITY;
    }
    const int end = band_start[b + 1];
    for (int k = band_start[b]; k < end; ++k) {
        const float2 zv = rec[k];
        const int c = rec_cell[k] - lo;
        n[c] += 1.0f;
        sz[c] += zv.x;
        sv[c] += zv.y;
        lo_z[c] = fmin(lo_z[c], zv.x);
        hi_z[c] = fmax(hi_z[c], zv.x);
    }
    for (int c = 0; c < span; ++c) {
        const int k = (int)n[c];
        const float inv_k = k ? 1.0f / n[c] : NAN;
        count[lo + c] = k;
        mean_z[lo + c] = sz[c] * inv_k;
        mean_v[lo + c] = sv[c] * inv_k;
        min_z[lo + c] = k ? lo_z[c] : NAN;
        max_z[lo + c] = k ? hi_z[c] : NAN;
    }
}
