/* ICP on a uniform grid: nearest neighbours, normals by PCA, point-to-plane normal equations.
 *
 * The grid holds M points sorted by cell (float4 rows, local coordinates: metres from the
 * grid origin); cell c covers points [cell_start[c], cell_start[c] + cell_count[c]) and a
 * linear-probing table maps packed cell keys to c.  With cells at least as large as the
 * search radius, the 27 cells around a point hold every neighbour within the radius, so the
 * searches are exact.  Neighbour cells are visited in ascending key order and points in
 * ascending order, so ties go to the smallest sorted index, as in the NumPy reference.
 */

#define ICP_SUMS 29  /* 21 upper-triangle JtJ + 6 Jtr + cost + count */

inline float3 apply_rt(__constant float *rt, float3 p) {
    return (float3)(rt[0] * p.x + rt[1] * p.y + rt[2] * p.z + rt[9],
                    rt[3] * p.x + rt[4] * p.y + rt[5] * p.z + rt[10],
                    rt[6] * p.x + rt[7] * p.y + rt[8] * p.z + rt[11]);
}

inline float3 load_row(__global const float *restrict rows, int stride, int i) {
    const size_t r = (size_t)i * stride;
    return (float3)(rows[r], rows[r + 1], rows[r + 2]);
}

/* Nearest grid point within sqrt(r2) of each query (moved by rt into the grid frame). */
__kernel void grid_nearest(__global const float *restrict queries, const int stride, const int n,
                           __constant float *rt, const float inv, const float r2,
                           __global const float4 *restrict grid,
                           __global const int *restrict cell_start,
                           __global const int *restrict cell_count,
                           __global const ulong *restrict table_keys,
                           __global const int *restrict table_values,
                           const uint mask, const uint shift,
                           __global int *restrict best_index, __global float *restrict best_d2) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const float3 p = apply_rt(rt, load_row(queries, stride, i));
    int best = -1;
    float best_d = INFINITY;
    int3 c;
    if (cell_of(p * inv, &c)) {
        for (int dz = -1; dz <= 1; ++dz)
        for (int dy = -1; dy <= 1; ++dy)
        for (int dx = -1; dx <= 1; ++dx) {
            const int3 nc = c + (int3)(dx, dy, dz);
            if (!cell_in_range(nc)) continue;
            const int cell = table_find(table_keys, table_values, mask, shift, pack_key(nc));
            if (cell < 0) continue;
            const int start = cell_start[cell], end = start + cell_count[cell];
            for (int j = start; j < end; ++j) {
                const float3 d = grid[j].xyz - p;
                const float d2 = dot(d, d);
                if (d2 <= r2 && d2 < best_d) { best_d = d2; best = j; }
            }
        }
    }
    best_index[i] = best;
    best_d2[i] = best_d;
}

/* Unit eigenvector of the smallest eigenvalue of a symmetric 3x3 matrix (closed form for
 * the eigenvalue, cross products of the shifted rows for the vector). */
inline float3 smallest_eigenvector(float a00, float a01, float a02, float a11, float a12, float a22) {
    const float p1 = a01 * a01 + a02 * a02 + a12 * a12;
    const float q = (a00 + a11 + a22) / 3.0f;
    const float b00 = a00 - q, b11 = a11 - q, b22 = a22 - q;
    const float p2 = b00 * b00 + b11 * b11 + b22 * b22 + 2.0f * p1;
    const float p = sqrt(p2 / 6.0f);
    if (!(p > 0.0f)) return (float3)(NAN, NAN, NAN);
    const float det = b00 * (b11 * b22 - a12 * a12) - a01 * (a01 * b22 - a12 * a02)
                    + a02 * (a01 * a12 - b11 * a02);
    const float r = clamp(det / (2.0f * p * p * p), -1.0f, 1.0f);
    const float phi = acos(r) / 3.0f;
    const float lambda = q + 2.0f * p * cos(phi + 2.0943951023931953f);
    const float3 r0 = (float3)(a00 - lambda, a01, a02);
    const float3 r1 = (float3)(a01, a11 - lambda, a12);
    const float3 r2 = (float3)(a02, a12, a22 - lambda);
    const float3 c01 = cross(r0, r1), c02 = cross(r0, r2), c12 = cross(r1, r2);
    const float d01 = dot(c01, c01), d02 = dot(c02, c02), d12 = dot(c12, c12);
    float3 v = c01;
    float dv = d01;
    if (d02 > dv) { v = c02; dv = d02; }
    if (d12 > dv) { v = c12; dv = d12; }
    if (!(dv > 0.0f)) return (float3)(NAN, NAN, NAN);
    return v * rsqrt(dv);
}

/* Normal of every grid point: PCA of its neighbours within sqrt(r2) (itself included);
 * NaN when fewer than min_neighbors. */
__kernel void grid_normals(const int m, const float inv, const float r2, const int min_neighbors,
                           __global const float4 *restrict grid,
                           __global const int *restrict cell_start,
                           __global const int *restrict cell_count,
                           __global const ulong *restrict table_keys,
                           __global const int *restrict table_values,
                           const uint mask, const uint shift,
                           __global float4 *restrict normals) {
    const int i = get_global_id(0);
    if (i >= m) return;
    const float3 p = grid[i].xyz;
    float3 s1 = (float3)(0.0f);
    float sxx = 0.0f, sxy = 0.0f, sxz = 0.0f, syy = 0.0f, syz = 0.0f, szz = 0.0f;
    int count = 0;
    int3 c;
    if (cell_of(p * inv, &c)) {
        for (int dz = -1; dz <= 1; ++dz)
        for (int dy = -1; dy <= 1; ++dy)
        for (int dx = -1; dx <= 1; ++dx) {
            const int3 nc = c + (int3)(dx, dy, dz);
            if (!cell_in_range(nc)) continue;
            const int cell = table_find(table_keys, table_values, mask, shift, pack_key(nc));
            if (cell < 0) continue;
            const int start = cell_start[cell], end = start + cell_count[cell];
            for (int j = start; j < end; ++j) {
                const float3 d = grid[j].xyz - p;
                if (dot(d, d) > r2) continue;
                s1 += d;
                sxx += d.x * d.x; sxy += d.x * d.y; sxz += d.x * d.z;
                syy += d.y * d.y; syz += d.y * d.z; szz += d.z * d.z;
                ++count;
            }
        }
    }
    if (count < min_neighbors) { normals[i] = (float4)(NAN, NAN, NAN, 0.0f); return; }
    const float k = 1.0f / (float)count;
    const float3 mu = s1 * k;
    const float3 v = smallest_eigenvector(sxx * k - mu.x * mu.x, sxy * k - mu.x * mu.y,
                                          sxz * k - mu.x * mu.z, syy * k - mu.y * mu.y,
                                          syz * k - mu.y * mu.z, szz * k - mu.z * mu.z);
    normals[i] = (float4)(v, 0.0f);
}

/* Point-to-plane Gauss-Newton sums over the matched sources, reduced per work-group.
 * Residual r = n . (R s + t - q), Jacobian J = [ (R s + t) x n, n ] for an increment
 * (w, d) applied on the left in the grid frame; weight = 1, or Huber with scale `huber`
 * (> 0).  Each group writes ICP_SUMS floats: JtJ upper triangle row-major, Jtr, sum w r^2,
 * number of terms.  Needs ICP_SUMS * local size floats of local memory. */
__kernel void plane_system(__global const float *restrict src, const int stride, const int n,
                           __constant float *rt, __global const int *restrict match,
                           __global const float4 *restrict grid,
                           __global const float4 *restrict normals, const float huber,
                           __local float *scratch, __global float *restrict partials) {
    float acc[ICP_SUMS];
    for (int k = 0; k < ICP_SUMS; ++k) acc[k] = 0.0f;
    for (int i = get_global_id(0); i < n; i += get_global_size(0)) {
        const int j = match[i];
        if (j < 0) continue;
        const float3 nrm = normals[j].xyz;
        if (!isfinite(nrm.x)) continue;
        const float3 p = apply_rt(rt, load_row(src, stride, i));
        const float r = dot(nrm, p - grid[j].xyz);
        float w = 1.0f;
        if (huber > 0.0f && fabs(r) > huber) w = huber / fabs(r);
        const float3 a = cross(p, nrm);
        const float J[6] = {a.x, a.y, a.z, nrm.x, nrm.y, nrm.z};
        int k = 0;
        for (int u = 0; u < 6; ++u)
            for (int v = u; v < 6; ++v) acc[k++] += w * J[u] * J[v];
        for (int u = 0; u < 6; ++u) acc[21 + u] += w * J[u] * r;
        acc[27] += w * r * r;
        acc[28] += 1.0f;
    }
    const int lid = get_local_id(0), size = get_local_size(0);
    for (int k = 0; k < ICP_SUMS; ++k) scratch[lid * ICP_SUMS + k] = acc[k];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int step = size / 2; step > 0; step >>= 1) {
        if (lid < step)
            for (int k = 0; k < ICP_SUMS; ++k)
                scratch[lid * ICP_SUMS + k] += scratch[(lid + step) * ICP_SUMS + k];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0)
        for (int k = 0; k < ICP_SUMS; ++k)
            partials[get_group_id(0) * ICP_SUMS + k] = scratch[k];
}
