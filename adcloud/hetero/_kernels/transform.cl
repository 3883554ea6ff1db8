/* Rigid transform of points: out = R * p + t, one work-item per point.
 * `points` rows have `stride` floats (x y z first); `rt` is R row-major then t (12 floats). */
__kernel void transform_points(__global const float *restrict points, const int stride,
                               const int n, __constant float *rt, __global float *restrict out) {
    const int i = get_global_id(0);
    if (i >= n) return;
    const float3 p = (float3)(points[(size_t)i * stride], points[(size_t)i * stride + 1],
                              points[(size_t)i * stride + 2]);
    const float3 r0 = (float3)(rt[0], rt[1], rt[2]);
    const float3 r1 = (float3)(rt[3], rt[4], rt[5]);
    const float3 r2 = (float3)(rt[6], rt[7], rt[8]);
    vstore3((float3)(dot(r0, p) + rt[9], dot(r1, p) + rt[10], dot(r2, p) + rt[11]), i, out);
}
