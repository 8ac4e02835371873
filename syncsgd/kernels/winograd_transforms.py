"""Winograd F(2x2, 3x3)'s four transforms (kernels/winograd.py) as compiled loops
(kernels/compiled.py): each tile's 16 points from and to registers and the cache, where numpy
makes a pass over the whole chunk per row of a transform. Each makes the numpy passes'
operations in their order, so the results are theirs to the bit.

Tiles are channels-last: a transform's rows of channels are `points` (16, tiles, channels),
the tile t = (sample * th + i) * tw + j covering rows 2i.. and columns 2j.. of its sample.
"""
import numpy as np

from syncsgd.kernels.compiled import kernel


@kernel
def tiles(image, points):
    """points = B^T d B of every 4x4 tile d of image (n, 2 th + 2, 2 tw + 2, C): rows first
    (d0 - d2, d1 + d2, d2 - d1, d1 - d3), then columns the same."""
    n, ph, pw, channels = image.shape
    th, tw = (ph - 2) // 2, (pw - 2) // 2
    u = np.empty((4, 4, channels), np.float32)
    for m in range(n):
        for i in range(th):
            for j in range(tw):
                t = (m * th + i) * tw + j
                for b in range(4):
                    d0, d1 = image[m, 2 * i, 2 * j + b], image[m, 2 * i + 1, 2 * j + b]
                    d2, d3 = image[m, 2 * i + 2, 2 * j + b], image[m, 2 * i + 3, 2 * j + b]
                    for c in range(channels):
                        u[0, b, c] = d0[c] - d2[c]
                        u[1, b, c] = d1[c] + d2[c]
                        u[2, b, c] = d2[c] - d1[c]
                        u[3, b, c] = d1[c] - d3[c]
                for r in range(4):
                    p0, p1, p2, p3 = (points[4 * r, t], points[4 * r + 1, t],
                                      points[4 * r + 2, t], points[4 * r + 3, t])
                    for c in range(channels):
                        p0[c] = u[r, 0, c] - u[r, 2, c]
                        p1[c] = u[r, 1, c] + u[r, 2, c]
                        p2[c] = u[r, 2, c] - u[r, 1, c]
                        p3[c] = u[r, 1, c] - u[r, 3, c]


@kernel
def outputs(points, out):
    """out (n, 2 th, 2 tw, K) = A^T M A of every tile's points M: over the tile's rows first
    (m0 + m1 + m2, m1 - m2 - m3), then over its columns the same."""
    n, h2, w2, k = out.shape
    th, tw = h2 // 2, w2 // 2
    u = np.empty((2, 4, k), np.float32)
    for m in range(n):
        for i in range(th):
            for j in range(tw):
                t = (m * th + i) * tw + j
                for s in range(4):
                    m0, m1, m2, m3 = (points[s, t], points[4 + s, t], points[8 + s, t],
                                      points[12 + s, t])
                    for c in range(k):
                        u[0, s, c] = (m0[c] + m1[c]) + m2[c]
                        u[1, s, c] = (m1[c] - m2[c]) - m3[c]
                for a in range(2):
                    y0, y1 = out[m, 2 * i + a, 2 * j], out[m, 2 * i + a, 2 * j + 1]
                    for c in range(k):
                        y0[c] = (u[a, 0, c] + u[a, 1, c]) + u[a, 2, c]
                        y1[c] = (u[a, 1, c] - u[a, 2, c]) - u[a, 3, c]


@kernel
def outputs_adjoint(dy, points):
    """points = A dY A^T of every 2x2 block of dy (n, 2 th, 2 tw, K), outputs' adjoint: over
    the block's columns first (dy0, dy0 + dy1, dy0 - dy1, -dy1), then over its rows."""
    n, h2, w2, k = dy.shape
    th, tw = h2 // 2, w2 // 2
    u = np.empty((2, 4, k), np.float32)
    for m in range(n):
        for i in range(th):
            for j in range(tw):
                t = (m * th + i) * tw + j
                for a in range(2):
                    y0, y1 = dy[m, 2 * i + a, 2 * j], dy[m, 2 * i + a, 2 * j + 1]
                    for c in range(k):
                        u[a, 0, c] = y0[c]
                        u[a, 1, c] = y0[c] + y1[c]
                        u[a, 2, c] = y0[c] - y1[c]
                        u[a, 3, c] = -y1[c]
                for s in range(4):
                    p0, p1, p2, p3 = (points[s, t], points[4 + s, t], points[8 + s, t],
                                      points[12 + s, t])
                    for c in range(k):
                        p0[c] = u[0, s, c]
                        p1[c] = u[0, s, c] + u[1, s, c]
                        p2[c] = u[0, s, c] - u[1, s, c]
                        p3[c] = -u[1, s, c]


@kernel
def untile(points, image, rows):
    """image (n, 2 th + 2, 2 tw + 2, C) = the sum over the tiles of B V B^T, tiles' adjoint,
    along columns into rows (4, th, 2 tw + 2, C) for a sample, then along its rows. Along an
    axis, entry 2j gets v0 of tile j and v1 + v2 - v0 of tile j - 1, entry 2j + 1 gets v1 - v2
    + v3 of tile j and -v3 of tile j - 1 (numpy's order: the later tile first)."""
    n, ph, pw, channels = image.shape
    th, tw = (ph - 2) // 2, (pw - 2) // 2
    for m in range(n):
        for r in range(4):
            for i in range(th):
                line = rows[r, i]
                for j in range(tw + 1):
                    even, odd = line[2 * j], line[2 * j + 1]
                    if j < tw:
                        t = (m * th + i) * tw + j
                        v0, v1 = points[4 * r, t], points[4 * r + 1, t]
                        v2, v3 = points[4 * r + 2, t], points[4 * r + 3, t]
                        for c in range(channels):
                            even[c] = v0[c]
                            odd[c] = (v1[c] - v2[c]) + v3[c]
                    else:
                        for c in range(channels):
                            even[c] = 0
                            odd[c] = 0
                    if j > 0:
                        t = (m * th + i) * tw + j - 1
                        v0, v1 = points[4 * r, t], points[4 * r + 1, t]
                        v2, v3 = points[4 * r + 2, t], points[4 * r + 3, t]
                        for c in range(channels):
                            even[c] = ((even[c] + v1[c]) + v2[c]) - v0[c]
                            odd[c] = odd[c] - v3[c]
        for i in range(th + 1):
            for x in range(pw):
                even, odd = image[m, 2 * i, x], image[m, 2 * i + 1, x]
                if i < th:
                    v0, v1, v2, v3 = rows[0, i, x], rows[1, i, x], rows[2, i, x], rows[3, i, x]
                    for c in range(channels):
                        even[c] = v0[c]
                        odd[c] = (v1[c] - v2[c]) + v3[c]
                else:
                    for c in range(channels):
                        even[c] = 0
                        odd[c] = 0
                if i > 0:
                    v0, v1 = rows[0, i - 1, x], rows[1, i - 1, x]
                    v2, v3 = rows[2, i - 1, x], rows[3, i - 1, x]
                    for c in range(channels):
                        even[c] = ((even[c] + v1[c]) + v2[c]) - v0[c]
                        odd[c] = odd[c] - v3[c]


@kernel
def channels_last(images, image, pad_h, pad_w):
    """image (n, ph, pw, C) = images (n, C, h, w) placed at (pad_h, pad_w), zeros around it;
    channels in blocks of 16, whose rows stay in the cache along a line."""
    n, channels, h, w = images.shape
    ph, pw = image.shape[1], image.shape[2]
    for m in range(n):
        for y in range(ph):
            line = image[m, y]
            if y < pad_h or y >= pad_h + h:
                line[:, :] = 0
                continue
            line[:pad_w, :] = 0
            line[pad_w + w:, :] = 0
            for c0 in range(0, channels, 16):
                for x in range(w):
                    to = line[pad_w + x]
                    for c in range(c0, min(c0 + 16, channels)):
                        to[c] = images[m, c, y - pad_h, x]


@kernel
def channels_first(source, out, bias, with_bias):
    """out (n, C, h, w) = source (n, h or more, w or more, C) cropped, + bias per channel where
    with_bias."""
    n, channels, h, w = out.shape
    for m in range(n):
        for y in range(h):
            line = source[m, y]
            for c in range(channels):
                to = out[m, c, y]
                if with_bias:
                    b = bias[c]
                    for x in range(w):
                        to[x] = line[x, c] + b
                else:
                    for x in range(w):
                        to[x] = line[x, c]
