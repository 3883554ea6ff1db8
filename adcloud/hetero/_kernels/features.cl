/* Image features: grey levels, gradients and HOG-style cell histograms with L2-Hys blocks.
 *
 *   hog_gray    per pixel: grey level (0..255) of a uint8 image with `channels` channels,
 *               weighted by (wr, wg, wb) -- or the single channel
 *   hog_votes   per pixel: central-difference gradient (edges clamped), its magnitude split
 *               linearly between the two nearest of `bins` unsigned-orientation bin centres
 *               over [0, pi)
 *   hog_cells   per (image, cell row, cell column): the votes of its pixels, summed
 *   hog_blocks  per (image, block row, block column): the 2x2 cells' histograms
 *               concatenated and L2-Hys normalised (L2, clip at 0.2, L2 again)
 */
#define MAX_BINS 32
#define HOG_EPS 1e-5f
#define HOG_CLIP 0.2f

__kernel void hog_gray(__global const uchar *restrict images, const int pixels, const int channels,
                       const float wr, const float wg, const float wb,
                       __global float *restrict gray) {
    const int i = get_global_id(0);
    if (i >= pixels) return;
    if (channels == 1) { gray[i] = (float)images[i]; return; }
    const size_t p = (size_t)i * channels;
    gray[i] = wr * (float)images[p] + wg * (float)images[p + 1] + wb * (float)images[p + 2];
}

/* Per pixel of the whole cells: the two linear votes of its gradient and the lower bin.
 * One work-item per pixel and no data-dependent indexing, so PoCL vectorises it across
 * work-items. */
__kernel void hog_votes(__global const float *restrict gray, const int count, const int height,
                        const int width, const int rows, const int cols, const int bins,
                        __global float2 *restrict votes, __global uchar *restrict lower) {
    /* a 3-D range (x, y, image): no integer division per pixel */
    const int x = get_global_id(0), y = get_global_id(1), image = get_global_id(2);
    if (x >= cols || y >= rows || image >= count) return;
    const size_t id = ((size_t)image * rows + y) * cols + x;
    __global const float *g = gray + (size_t)image * height * width;
    const int up = max(y - 1, 0), down = min(y + 1, height - 1);
    const int left = max(x - 1, 0), right = min(x + 1, width - 1);
    const float gx = g[y * width + right] - g[y * width + left];
    const float gy = g[down * width + x] - g[up * width + x];
    const float magnitude = sqrt(gx * gx + gy * gy);
    /* orientation in half turns; atan2pi is several times faster than atan2 in PoCL */
    float turn = atan2pi(gy, gx);
    turn = turn < 0.0f ? turn + 1.0f : turn;
    const float position = turn * (float)bins - 0.5f;
    const float floor_position = floor(position);
    const float frac = position - floor_position;
    int b0 = (int)floor_position;
    b0 = b0 < 0 ? b0 + bins : (b0 >= bins ? b0 - bins : b0);
    votes[id] = magnitude > 0.0f ? (float2)(magnitude * (1.0f - frac), magnitude * frac)
                                 : (float2)(0.0f, 0.0f);
    lower[id] = (uchar)b0;
}

/* Per (image, cell row, cell column): the votes of the cell's pixels into its histogram. */
__kernel void hog_cells(__global const float2 *restrict votes, __global const uchar *restrict lower,
                        const int count, const int cell, const int bins, const int cells_y,
                        const int cells_x, __global float *restrict hist) {
    const int id = get_global_id(0);
    if (id >= count * cells_y * cells_x) return;
    const int image = id / (cells_y * cells_x);
    const int cy = (id / cells_x) % cells_y, cx = id % cells_x;
    const int cols = cells_x * cell;
    const size_t base = (size_t)image * cells_y * cell * cols;
    float h[MAX_BINS];
    for (int b = 0; b < bins; ++b) h[b] = 0.0f;
    for (int y = cy * cell; y < (cy + 1) * cell; ++y) {
        const size_t row = base + (size_t)y * cols;
        for (int x = cx * cell; x < (cx + 1) * cell; ++x) {
            const float2 v = votes[row + x];
            const int b0 = lower[row + x];
            h[b0] += v.x;
            h[b0 + 1 == bins ? 0 : b0 + 1] += v.y;
        }
    }
    __global float *out = hist + (size_t)id * bins;
    for (int b = 0; b < bins; ++b) out[b] = h[b];
}

__kernel void hog_blocks(__global const float *restrict hist, const int count, const int bins,
                         const int cells_y, const int cells_x, __global float *restrict out) {
    const int blocks_y = cells_y - 1, blocks_x = cells_x - 1;
    const int id = get_global_id(0);
    if (id >= count * blocks_y * blocks_x) return;
    const int image = id / (blocks_y * blocks_x);
    const int by = (id / blocks_x) % blocks_y, bx = id % blocks_x;
    const int n = 4 * bins;
    __global float *dst = out + (size_t)id * n;
    float norm = 0.0f;
    int k = 0;
    for (int dy = 0; dy < 2; ++dy)
        for (int dx = 0; dx < 2; ++dx) {
            const size_t c = ((size_t)image * cells_y + by + dy) * cells_x + bx + dx;
            for (int b = 0; b < bins; ++b) {
                const float v = hist[c * bins + b];
                dst[k++] = v;
                norm += v * v;
            }
        }
    float inv = 1.0f / sqrt(norm + HOG_EPS * HOG_EPS);
    float norm2 = 0.0f;
    for (int j = 0; j < n; ++j) {
        const float v = fmin(dst[j] * inv, HOG_CLIP);
        dst[j] = v;
        norm2 += v * v;
    }
    inv = 1.0f / sqrt(norm2 + HOG_EPS * HOG_EPS);
    for (int j = 0; j < n; ++j) dst[j] *= inv;
}
