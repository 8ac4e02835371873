"""Winograd's transforms (kernels/winograd.py) as compiled loops (kernels/compiled.py): each
tile's points from and to registers and the cache, where numpy makes a pass over the whole
chunk per row of a transform. F(2x2, 3x3)'s make the numpy passes' operations in their order,
so the results are theirs to the bit.

Tiles are channels-last: a transform's rows of channels are `points` (16, tiles, channels) for
F(2x2, 3x3), the tile t = (sample * th + i) * tw + j covering rows 2i.. and columns 2j.. of its
sample; the 6x6 and 8x8 tiles below are laid out the same way.
Each kernel runs on the samples first..last - 1 of its arrays, so that threads can share a
batch out (kernels/winograd.py) on whole arrays, whose loops Numba compiles for contiguous
layouts.
"""
import numpy as np

from syncsgd.kernels.compiled import kernel


@kernel
def tiles(image, points, first, last):
    """points = B^T d B of every 4x4 tile d of image (n, 2 th + 2, 2 tw + 2, C): rows first
    (d0 - d2, d1 + d2, d2 - d1, d1 - d3), for a band of 4 rows at once ("Winograd's
    transforms": one long loop over the band's columns and channels), then columns the same
    per tile."""
    _, ph, pw, channels = image.shape
    th, tw = (ph - 2) // 2, (pw - 2) // 2
    band = np.empty((4, pw * channels), np.float32)
    u0, u1, u2, u3 = band[0], band[1], band[2], band[3]
    for m in range(first, last):
        for i in range(th):
            d0, d1 = image[m, 2 * i].reshape(-1), image[m, 2 * i + 1].reshape(-1)
            d2, d3 = image[m, 2 * i + 2].reshape(-1), image[m, 2 * i + 3].reshape(-1)
            for k in range(pw * channels):
                u0[k] = d0[k] - d2[k]
                u1[k] = d1[k] + d2[k]
                u2[k] = d2[k] - d1[k]
                u3[k] = d1[k] - d3[k]
            for j in range(tw):
                t = (m * th + i) * tw + j
                for r in range(4):
                    q = band[r, 2 * j * channels:(2 * j + 4) * channels]
                    p0, p1, p2, p3 = (points[4 * r, t], points[4 * r + 1, t],
                                      points[4 * r + 2, t], points[4 * r + 3, t])
                    for c in range(channels):
                        q0, q1 = q[c], q[channels + c]
                        q2, q3 = q[2 * channels + c], q[3 * channels + c]
                        p0[c] = q0 - q2
                        p1[c] = q1 + q2
                        p2[c] = q2 - q1
                        p3[c] = q1 - q3


@kernel
def outputs(points, out, first, last):
    """out (n, 2 th, 2 tw, K) = A^T M A of every tile's points M: over the tile's rows first
    (m0 + m1 + m2, m1 - m2 - m3), then over its columns the same."""
    _, h2, w2, k = out.shape
    th, tw = h2 // 2, w2 // 2
    u = np.empty((2, 4, k), np.float32)
    for m in range(first, last):
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
def outputs_adjoint(dy, points, first, last):
    """points = A dY A^T of every 2x2 block of dy (n, 2 th, 2 tw, K), outputs' adjoint: over
    the block's columns first (dy0, dy0 + dy1, dy0 - dy1, -dy1), then over its rows."""
    _, h2, w2, k = dy.shape
    th, tw = h2 // 2, w2 // 2
    u = np.empty((2, 4, k), np.float32)
    for m in range(first, last):
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
def untile(points, image, rows, first, last):
    """image (n, 2 th + 2, 2 tw + 2, C) = the sum over the tiles of B V B^T, tiles' adjoint,
    along columns into rows (4, th, 2 tw + 2, C) for a sample, then along its rows. Along an
    axis, entry 2j gets v0 of tile j and v1 + v2 - v0 of tile j - 1, entry 2j + 1 gets v1 - v2
    + v3 of tile j and -v3 of tile j - 1 (numpy's order: the later tile first)."""
    _, ph, pw, channels = image.shape
    th, tw = (ph - 2) // 2, (pw - 2) // 2
    for m in range(first, last):
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
def channels_last(images, image, pad_h, pad_w, first, last):
    """image (n, ph, pw, C) = images (n, C, h, w) placed at (pad_h, pad_w), zeros around it;
    each pixel's channels written in order, read across the C rows of the plane (reading each
    row in order and writing across the line was 1.6-3.4x slower with the images out of the
    cache: docs/performance.md, "Winograd's channels-last images"). The line and the plane are
    views taken once a row: an index such as pad_w + x in the loop costs Numba a check for
    negative indices each time, half the speed ("Winograd's transforms")."""
    _, channels, h, w = images.shape
    ph = image.shape[1]
    for m in range(first, last):
        for y in range(ph):
            line = image[m, y]
            if y < pad_h or y >= pad_h + h:
                line[:, :] = 0
                continue
            line[:pad_w, :] = 0
            line[pad_w + w:, :] = 0
            plane, inner = images[m, :, y - pad_h], line[pad_w:pad_w + w]
            for x in range(w):
                pixel = inner[x]
                for c in range(channels):
                    pixel[c] = plane[c, x]


@kernel
def channels_first(source, out, bias, with_bias, first, last):
    """out (n, C, h, w) = source (n, h or more, w or more, C) cropped, + bias per channel where
    with_bias; each pixel's channels read in order, written across the C rows (as
    channels_last, the faster order: "Winograd's channels-last images")."""
    _, channels, h, w = out.shape
    for m in range(first, last):
        for y in range(h):
            line, plane = source[m, y], out[m, :, y]
            for x in range(w):
                pixel = line[x]
                if with_bias:
                    for c in range(channels):
                        plane[c, x] = pixel[c] + bias[c]
                else:
                    for c in range(channels):
                        plane[c, x] = pixel[c]


@kernel
def space_to_depth(images, image, pad_h, pad_w, stride, first, last):
    """image (n, ph, pw, C s s) = the space-to-depth of images (n, C, h, w) padded by (pad_h,
    pad_w), zeros around it: channel (c s + dy) s + dx of pixel (Y, X) is pixel (s Y + dy - pad_h,
    s X + dx - pad_w) of channel c (kernels/winograd.py, strided convolutions)."""
    _, channels, h, w = images.shape
    ph, pw = image.shape[1], image.shape[2]
    for m in range(first, last):
        image[m] = 0
        for c in range(channels):
            for y in range(min(h, stride * ph - pad_h)):
                line = image[m, (y + pad_h) // stride]
                base = (c * stride + (y + pad_h) % stride) * stride
                row = images[m, c, y]
                for x in range(min(w, stride * pw - pad_w)):
                    line[(x + pad_w) // stride, base + (x + pad_w) % stride] = row[x]


@kernel
def depth_to_space(image, images, pad_h, pad_w, stride, first, last):
    """images (n, C, h, w) = the pixels of image (n, ph, pw, C s s) that space_to_depth took
    them to (the padding's dropped); zeros for the last rows and columns where they fall
    beyond it (no output reads them)."""
    _, channels, h, w = images.shape
    ph, pw = image.shape[1], image.shape[2]
    rows, columns = min(h, stride * ph - pad_h), min(w, stride * pw - pad_w)
    for m in range(first, last):
        for c in range(channels):
            for y in range(h):
                row = images[m, c, y]
                if y >= rows:
                    row[:] = 0
                    continue
                line = image[m, (y + pad_h) // stride]
                base = (c * stride + (y + pad_h) % stride) * stride
                for x in range(columns):
                    row[x] = line[(x + pad_w) // stride, base + (x + pad_w) % stride]
                row[columns:] = 0


# -- 6x6 tiles: F(4x4, 3x3) and F(2x2, 5x5) -------------------------------------------------------
# Tiles of 6x6 points, one every `step` pixels (4 for F(4x4, 3x3), 2 for F(2x2, 5x5)): points
# (36, tiles, channels), tile t covering rows step i.. and columns step j.. of its sample. Both
# take Lavin and Gray's points 0, +-1, +-2 and infinity, so both have the same B (tiles6,
# untile6); their A differ (outputs4, outputs5). Each 1-D transform shares its sums and
# differences between rows (no numpy passes to match here).
# Their constants are float32: a Python float would make Numba compute each sum in float64 and
# round it, scalar code at half the speed (docs/performance.md, "Winograd's transforms").
TWO, FOUR, FIVE, EIGHT = np.float32(2), np.float32(4), np.float32(5), np.float32(8)

@kernel
def tiles6(image, points, step, first, last):
    """points = B^T d B of every 6x6 tile d of image (n, step th + 6 - step, step tw + 6 -
    step, C), along the tile's columns first, for a band of 6 rows at once (one long loop, as
    in `tiles`), then along its rows per tile."""
    _, ph, pw, channels = image.shape
    th, tw = (ph - 6) // step + 1, (pw - 6) // step + 1
    band = np.empty((6, pw * channels), np.float32)
    u0, u1, u2, u3, u4, u5 = band[0], band[1], band[2], band[3], band[4], band[5]
    for m in range(first, last):
        for i in range(th):
            y = step * i
            d0, d1 = image[m, y].reshape(-1), image[m, y + 1].reshape(-1)
            d2, d3 = image[m, y + 2].reshape(-1), image[m, y + 3].reshape(-1)
            d4, d5 = image[m, y + 4].reshape(-1), image[m, y + 5].reshape(-1)
            for k in range(pw * channels):
                a, e = d4[k] - FOUR * d2[k], d3[k] - FOUR * d1[k]
                f, g = d4[k] - d2[k], TWO * (d3[k] - d1[k])
                u0[k] = (FOUR * d0[k] + d4[k]) - FIVE * d2[k]
                u1[k] = a + e
                u2[k] = a - e
                u3[k] = f + g
                u4[k] = f - g
                u5[k] = (FOUR * d1[k] + d5[k]) - FIVE * d3[k]
            for j in range(tw):
                t = (m * th + i) * tw + j
                for r in range(6):
                    q = band[r, step * j * channels:(step * j + 6) * channels]
                    p0, p1, p2 = points[6 * r, t], points[6 * r + 1, t], points[6 * r + 2, t]
                    p3, p4, p5 = points[6 * r + 3, t], points[6 * r + 4, t], points[6 * r + 5, t]
                    for c in range(channels):
                        q0, q1, q2 = q[c], q[channels + c], q[2 * channels + c]
                        q3, q4, q5 = q[3 * channels + c], q[4 * channels + c], q[5 * channels + c]
                        a, e = q4 - FOUR * q2, q3 - FOUR * q1
                        f, g = q4 - q2, TWO * (q3 - q1)
                        p0[c] = (FOUR * q0 + q4) - FIVE * q2
                        p1[c] = a + e
                        p2[c] = a - e
                        p3[c] = f + g
                        p4[c] = f - g
                        p5[c] = (FOUR * q1 + q5) - FIVE * q3


@kernel
def outputs4(points, out, first, last):
    """out (n, 4 th, 4 tw, K) = A^T M A of every tile's 36 points M, over the tile's rows
    first (y0 = m0 + m1 + m2 + m3 + m4, y1 = m1 - m2 + 2 (m3 - m4), y2 = m1 + m2 + 4 (m3 + m4),
    y3 = m1 - m2 + 8 (m3 - m4) + m5), then over its columns."""
    _, h4, w4, k = out.shape
    th, tw = h4 // 4, w4 // 4
    u = np.empty((4, 6, k), np.float32)
    for m in range(first, last):
        for i in range(th):
            for j in range(tw):
                t = (m * th + i) * tw + j
                for s in range(6):
                    m0, m1, m2 = points[s, t], points[6 + s, t], points[12 + s, t]
                    m3, m4, m5 = points[18 + s, t], points[24 + s, t], points[30 + s, t]
                    for c in range(k):
                        a, b = m1[c] + m2[c], m1[c] - m2[c]
                        e, f = m3[c] + m4[c], m3[c] - m4[c]
                        u[0, s, c] = (m0[c] + a) + e
                        u[1, s, c] = b + TWO * f
                        u[2, s, c] = a + FOUR * e
                        u[3, s, c] = (b + EIGHT * f) + m5[c]
                for r in range(4):
                    y0, y1 = out[m, 4 * i + r, 4 * j], out[m, 4 * i + r, 4 * j + 1]
                    y2, y3 = out[m, 4 * i + r, 4 * j + 2], out[m, 4 * i + r, 4 * j + 3]
                    for c in range(k):
                        a, b = u[r, 1, c] + u[r, 2, c], u[r, 1, c] - u[r, 2, c]
                        e, f = u[r, 3, c] + u[r, 4, c], u[r, 3, c] - u[r, 4, c]
                        y0[c] = (u[r, 0, c] + a) + e
                        y1[c] = b + TWO * f
                        y2[c] = a + FOUR * e
                        y3[c] = (b + EIGHT * f) + u[r, 5, c]


@kernel
def outputs4_adjoint(dy, points, first, last):
    """points = A dY A^T of every 4x4 block of dy (n, 4 th, 4 tw, K), outputs4's adjoint:
    p0 = y0, p1,2 = (y0 + y2) +- (y1 + y3), p3,4 = (y0 + 4 y2) +- (2 y1 + 8 y3), p5 = y3, over
    the block's columns first, then over its rows."""
    _, h4, w4, k = dy.shape
    th, tw = h4 // 4, w4 // 4
    u = np.empty((4, 6, k), np.float32)
    for m in range(first, last):
        for i in range(th):
            for j in range(tw):
                t = (m * th + i) * tw + j
                for r in range(4):
                    y0, y1 = dy[m, 4 * i + r, 4 * j], dy[m, 4 * i + r, 4 * j + 1]
                    y2, y3 = dy[m, 4 * i + r, 4 * j + 2], dy[m, 4 * i + r, 4 * j + 3]
                    for c in range(k):
                        a, b = y0[c] + y2[c], y1[c] + y3[c]
                        e, f = y0[c] + FOUR * y2[c], TWO * y1[c] + EIGHT * y3[c]
                        u[r, 0, c] = y0[c]
                        u[r, 1, c] = a + b
                        u[r, 2, c] = a - b
                        u[r, 3, c] = e + f
                        u[r, 4, c] = e - f
                        u[r, 5, c] = y3[c]
                for s in range(6):
                    p0, p1, p2 = points[s, t], points[6 + s, t], points[12 + s, t]
                    p3, p4, p5 = points[18 + s, t], points[24 + s, t], points[30 + s, t]
                    for c in range(k):
                        a, b = u[0, s, c] + u[2, s, c], u[1, s, c] + u[3, s, c]
                        e = u[0, s, c] + FOUR * u[2, s, c]
                        f = TWO * u[1, s, c] + EIGHT * u[3, s, c]
                        p0[c] = u[0, s, c]
                        p1[c] = a + b
                        p2[c] = a - b
                        p3[c] = e + f
                        p4[c] = e - f
                        p5[c] = u[3, s, c]


@kernel
def untile6(points, image, step, first, last):
    """image (n, step th + 6 - step, step tw + 6 - step, C) = the sum over the tiles of B V
    B^T, tiles6's adjoint:
    d0 = 4 v0, d1 = 4 (v2 - v1) + 2 (v4 - v3) + 4 v5, d2 = -5 v0 - 4 (v1 + v2) - (v3 + v4),
    d3 = (v1 - v2) + 2 (v3 - v4) - 5 v5, d4 = v0 + (v1 + v2) + (v3 + v4), d5 = v5, along each
    tile's columns first, added into a band of 6 rows, then along the band's rows at once
    (one long loop, as in `tiles`), added into the image; tiles and bands in order, so sums
    do not depend on timing."""
    _, ph, pw, channels = image.shape
    th, tw = (ph - 6) // step + 1, (pw - 6) // step + 1
    band = np.empty((6, pw * channels), np.float32)
    u0, u1, u2, u3, u4, u5 = band[0], band[1], band[2], band[3], band[4], band[5]
    image[first:last] = 0
    for m in range(first, last):
        for i in range(th):
            band[:, :] = 0
            for j in range(tw):
                t = (m * th + i) * tw + j
                for r in range(6):
                    v0, v1, v2 = points[6 * r, t], points[6 * r + 1, t], points[6 * r + 2, t]
                    v3, v4, v5 = points[6 * r + 3, t], points[6 * r + 4, t], points[6 * r + 5, t]
                    q = band[r, step * j * channels:(step * j + 6) * channels]
                    for c in range(channels):
                        a, b = v1[c] + v2[c], v2[c] - v1[c]
                        e, f = v3[c] + v4[c], v4[c] - v3[c]
                        q[c] += FOUR * v0[c]
                        q[channels + c] += (FOUR * b + TWO * f) + FOUR * v5[c]
                        q[2 * channels + c] += (-FIVE * v0[c] - FOUR * a) - e
                        q[3 * channels + c] += (-b - TWO * f) - FIVE * v5[c]
                        q[4 * channels + c] += (v0[c] + a) + e
                        q[5 * channels + c] += v5[c]
            y = step * i
            d0, d1 = image[m, y].reshape(-1), image[m, y + 1].reshape(-1)
            d2, d3 = image[m, y + 2].reshape(-1), image[m, y + 3].reshape(-1)
            d4, d5 = image[m, y + 4].reshape(-1), image[m, y + 5].reshape(-1)
            for k in range(pw * channels):
                a, b = u1[k] + u2[k], u2[k] - u1[k]
                e, f = u3[k] + u4[k], u4[k] - u3[k]
                d0[k] += FOUR * u0[k]
                d1[k] += (FOUR * b + TWO * f) + FOUR * u5[k]
                d2[k] += (-FIVE * u0[k] - FOUR * a) - e
                d3[k] += (-b - TWO * f) - FIVE * u5[k]
                d4[k] += (u0[k] + a) + e
                d5[k] += u5[k]


@kernel
def outputs5(points, out, first, last):
    """out (n, 2 th, 2 tw, K) = A^T M A of every tile's 36 points M for F(2x2, 5x5), over the
    tile's rows first (y0 = m0 + m1 + m2 + m3 + m4, y1 = m1 - m2 + 2 (m3 - m4) + m5), then
    over its columns."""
    _, h2, w2, k = out.shape
    th, tw = h2 // 2, w2 // 2
    u = np.empty((2, 6, k), np.float32)
    for m in range(first, last):
        for i in range(th):
            for j in range(tw):
                t = (m * th + i) * tw + j
                for s in range(6):
                    m0, m1, m2 = points[s, t], points[6 + s, t], points[12 + s, t]
                    m3, m4, m5 = points[18 + s, t], points[24 + s, t], points[30 + s, t]
                    for c in range(k):
                        a, b = m1[c] + m2[c], m1[c] - m2[c]
                        u[0, s, c] = (m0[c] + a) + (m3[c] + m4[c])
                        u[1, s, c] = (b + TWO * (m3[c] - m4[c])) + m5[c]
                for r in range(2):
                    y0, y1 = out[m, 2 * i + r, 2 * j], out[m, 2 * i + r, 2 * j + 1]
                    for c in range(k):
                        a, b = u[r, 1, c] + u[r, 2, c], u[r, 1, c] - u[r, 2, c]
                        y0[c] = (u[r, 0, c] + a) + (u[r, 3, c] + u[r, 4, c])
                        y1[c] = (b + TWO * (u[r, 3, c] - u[r, 4, c])) + u[r, 5, c]


@kernel
def outputs5_adjoint(dy, points, first, last):
    """points = A dY A^T of every 2x2 block of dy (n, 2 th, 2 tw, K), outputs5's adjoint:
    p0 = y0, p1,2 = y0 +- y1, p3,4 = y0 +- 2 y1, p5 = y1, over the block's columns first,
    then over its rows."""
    _, h2, w2, k = dy.shape
    th, tw = h2 // 2, w2 // 2
    u = np.empty((2, 6, k), np.float32)
    for m in range(first, last):
        for i in range(th):
            for j in range(tw):
                t = (m * th + i) * tw + j
                for r in range(2):
                    y0, y1 = dy[m, 2 * i + r, 2 * j], dy[m, 2 * i + r, 2 * j + 1]
                    for c in range(k):
                        u[r, 0, c] = y0[c]
                        u[r, 1, c] = y0[c] + y1[c]
                        u[r, 2, c] = y0[c] - y1[c]
                        u[r, 3, c] = y0[c] + TWO * y1[c]
                        u[r, 4, c] = y0[c] - TWO * y1[c]
                        u[r, 5, c] = y1[c]
                for s in range(6):
                    p0, p1, p2 = points[s, t], points[6 + s, t], points[12 + s, t]
                    p3, p4, p5 = points[18 + s, t], points[24 + s, t], points[30 + s, t]
                    for c in range(k):
                        y0, y1 = u[0, s, c], u[1, s, c]
                        p0[c] = y0
                        p1[c] = y0 + y1
                        p2[c] = y0 - y1
                        p3[c] = y0 + TWO * y1
                        p4[c] = y0 - TWO * y1
                        p5[c] = y1


# -- 8x8 tiles: F(4x4, 5x5) -------------------------------------------------------------------
# Tiles of 8x8 points, one every 4 pixels: points (64, tiles, channels), laid out as the 6x6
# ones. The points 0, +-1, +-2, +-1/2 and infinity, so B^T is the usual one of F(6x6, 3x3):
#   u0 = (d0 - d6) + 21/4 (d4 - d2),            u7 = (d7 - d1) + 21/4 (d3 - d5),
#   u1,2 = (d2 + d6 - 17/4 d4) +- (d1 + d5 - 17/4 d3),
#   u3,4 = (d6 + d2 / 4 - 5/4 d4) +- (d1 / 2 - 5/2 d3 + 2 d5),
#   u5,6 = (d6 + 4 d2 - 5 d4) +- (2 d1 - 5/2 d3 + d5 / 2);
# and A^T's rows are the points' powers 0 .. 3 (infinity adding to the last). Every constant is
# exact in float32.
HALF, QUARTER, EIGHTH = np.float32(0.5), np.float32(0.25), np.float32(0.125)
FIVE_QUARTERS, FIVE_HALVES = np.float32(1.25), np.float32(2.5)
SEVENTEEN_QUARTERS, TWENTY_ONE_QUARTERS = np.float32(4.25), np.float32(5.25)


@kernel
def tiles8(image, points, first, last):
    """points = B^T d B of every 8x8 tile d of image (n, 4 th + 4, 4 tw + 4, C), along the
    tile's columns first, for a band of 8 rows at once (as tiles6), then along its rows per
    tile."""
    _, ph, pw, channels = image.shape
    th, tw = (ph - 4) // 4, (pw - 4) // 4
    band = np.empty((8, pw * channels), np.float32)
    u0, u1, u2, u3 = band[0], band[1], band[2], band[3]
    u4, u5, u6, u7 = band[4], band[5], band[6], band[7]
    for m in range(first, last):
        for i in range(th):
            y = 4 * i
            d0, d1 = image[m, y].reshape(-1), image[m, y + 1].reshape(-1)
            d2, d3 = image[m, y + 2].reshape(-1), image[m, y + 3].reshape(-1)
            d4, d5 = image[m, y + 4].reshape(-1), image[m, y + 5].reshape(-1)
            d6, d7 = image[m, y + 6].reshape(-1), image[m, y + 7].reshape(-1)
            for k in range(pw * channels):
                u0[k], u1[k], u2[k], u3[k], u4[k], u5[k], u6[k], u7[k] = _tile8(
                    d0[k], d1[k], d2[k], d3[k], d4[k], d5[k], d6[k], d7[k])
            for j in range(tw):
                t = (m * th + i) * tw + j
                for r in range(8):
                    q = band[r, 4 * j * channels:(4 * j + 8) * channels]
                    p0, p1 = points[8 * r, t], points[8 * r + 1, t]
                    p2, p3 = points[8 * r + 2, t], points[8 * r + 3, t]
                    p4, p5 = points[8 * r + 4, t], points[8 * r + 5, t]
                    p6, p7 = points[8 * r + 6, t], points[8 * r + 7, t]
                    for c in range(channels):
                        p0[c], p1[c], p2[c], p3[c], p4[c], p5[c], p6[c], p7[c] = _tile8(
                            q[c], q[channels + c], q[2 * channels + c], q[3 * channels + c],
                            q[4 * channels + c], q[5 * channels + c], q[6 * channels + c],
                            q[7 * channels + c])


@kernel
def _tile8(d0, d1, d2, d3, d4, d5, d6, d7):
    """B^T of 8 values (the comment above)."""
    a = (d2 + d6) - SEVENTEEN_QUARTERS * d4
    b = (d1 + d5) - SEVENTEEN_QUARTERS * d3
    e = (d6 + QUARTER * d2) - FIVE_QUARTERS * d4
    f = (HALF * d1 - FIVE_HALVES * d3) + TWO * d5
    g = (d6 + FOUR * d2) - FIVE * d4
    h = (TWO * d1 - FIVE_HALVES * d3) + HALF * d5
    return ((d0 - d6) + TWENTY_ONE_QUARTERS * (d4 - d2), a + b, a - b, e + f, e - f, g + h,
            g - h, (d7 - d1) + TWENTY_ONE_QUARTERS * (d3 - d5))


@kernel
def _untile8(v0, v1, v2, v3, v4, v5, v6, v7):
    """B of 8 values, _tile8's adjoint."""
    a, b = v1 + v2, v1 - v2
    e, f = v3 + v4, v3 - v4
    g, h = v5 + v6, v5 - v6
    return (v0, ((b + HALF * f) + TWO * h) - v7,
            ((a - TWENTY_ONE_QUARTERS * v0) + QUARTER * e) + FOUR * g,
            ((TWENTY_ONE_QUARTERS * v7 - SEVENTEEN_QUARTERS * b) - FIVE_HALVES * f)
            - FIVE_HALVES * h,
            ((TWENTY_ONE_QUARTERS * v0 - SEVENTEEN_QUARTERS * a) - FIVE_QUARTERS * e)
            - FIVE * g,
            ((b + TWO * f) + HALF * h) - TWENTY_ONE_QUARTERS * v7,
            ((a - v0) + e) + g, v7)


@kernel
def untile8(points, image, first, last):
    """image (n, 4 th + 4, 4 tw + 4, C) = the sum over the tiles of B V B^T, tiles8's adjoint,
    along each tile's columns first, added into a band of 8 rows, then along the band's rows
    at once, added into the image; tiles and bands in order, so sums do not depend on
    timing."""
    _, ph, pw, channels = image.shape
    th, tw = (ph - 4) // 4, (pw - 4) // 4
    band = np.empty((8, pw * channels), np.float32)
    u0, u1, u2, u3 = band[0], band[1], band[2], band[3]
    u4, u5, u6, u7 = band[4], band[5], band[6], band[7]
    image[first:last] = 0
    for m in range(first, last):
        for i in range(th):
            band[:, :] = 0
            for j in range(tw):
                t = (m * th + i) * tw + j
                for r in range(8):
                    v0, v1 = points[8 * r, t], points[8 * r + 1, t]
                    v2, v3 = points[8 * r + 2, t], points[8 * r + 3, t]
                    v4, v5 = points[8 * r + 4, t], points[8 * r + 5, t]
                    v6, v7 = points[8 * r + 6, t], points[8 * r + 7, t]
                    q = band[r, 4 * j * channels:(4 * j + 8) * channels]
                    for c in range(channels):
                        e0, e1, e2, e3, e4, e5, e6, e7 = _untile8(
                            v0[c], v1[c], v2[c], v3[c], v4[c], v5[c], v6[c], v7[c])
                        q[c] += e0
                        q[channels + c] += e1
                        q[2 * channels + c] += e2
                        q[3 * channels + c] += e3
                        q[4 * channels + c] += e4
                        q[5 * channels + c] += e5
                        q[6 * channels + c] += e6
                        q[7 * channels + c] += e7
            y = 4 * i
            d0, d1 = image[m, y].reshape(-1), image[m, y + 1].reshape(-1)
            d2, d3 = image[m, y + 2].reshape(-1), image[m, y + 3].reshape(-1)
            d4, d5 = image[m, y + 4].reshape(-1), image[m, y + 5].reshape(-1)
            d6, d7 = image[m, y + 6].reshape(-1), image[m, y + 7].reshape(-1)
            for k in range(pw * channels):
                e0, e1, e2, e3, e4, e5, e6, e7 = _untile8(
                    u0[k], u1[k], u2[k], u3[k], u4[k], u5[k], u6[k], u7[k])
                d0[k] += e0
                d1[k] += e1
                d2[k] += e2
                d3[k] += e3
                d4[k] += e4
                d5[k] += e5
                d6[k] += e6
                d7[k] += e7


@kernel
def _outputs45(m0, m1, m2, m3, m4, m5, m6, m7):
    """A^T of 8 values: 4 outputs."""
    a, b = m1 + m2, m1 - m2
    e, f = m3 + m4, m3 - m4
    g, h = m5 + m6, m5 - m6
    return (((m0 + a) + e) + g, (b + TWO * f) + HALF * h, (a + FOUR * e) + QUARTER * g,
            ((b + EIGHT * f) + EIGHTH * h) + m7)


@kernel
def _outputs45_adjoint(y0, y1, y2, y3):
    """A of 4 values: 8 points, _outputs45's adjoint."""
    a, b = y0 + y2, y1 + y3
    e, f = y0 + FOUR * y2, TWO * y1 + EIGHT * y3
    g, h = y0 + QUARTER * y2, HALF * y1 + EIGHTH * y3
    return y0, a + b, a - b, e + f, e - f, g + h, g - h, y3


@kernel
def outputs45(points, out, first, last):
    """out (n, 4 th, 4 tw, K) = A^T M A of every tile's 64 points M for F(4x4, 5x5), over the
    tile's rows first, then over its columns."""
    _, h4, w4, k = out.shape
    th, tw = h4 // 4, w4 // 4
    u = np.empty((4, 8, k), np.float32)
    for m in range(first, last):
        for i in range(th):
            for j in range(tw):
                t = (m * th + i) * tw + j
                for s in range(8):
                    m0, m1, m2, m3 = points[s, t], points[8 + s, t], points[16 + s, t], \
                        points[24 + s, t]
                    m4, m5, m6, m7 = points[32 + s, t], points[40 + s, t], points[48 + s, t], \
                        points[56 + s, t]
                    for c in range(k):
                        u[0, s, c], u[1, s, c], u[2, s, c], u[3, s, c] = _outputs45(
                            m0[c], m1[c], m2[c], m3[c], m4[c], m5[c], m6[c], m7[c])
                for r in range(4):
                    y0, y1 = out[m, 4 * i + r, 4 * j], out[m, 4 * i + r, 4 * j + 1]
                    y2, y3 = out[m, 4 * i + r, 4 * j + 2], out[m, 4 * i + r, 4 * j + 3]
                    for c in range(k):
                        y0[c], y1[c], y2[c], y3[c] = _outputs45(
                            u[r, 0, c], u[r, 1, c], u[r, 2, c], u[r, 3, c], u[r, 4, c],
                            u[r, 5, c], u[r, 6, c], u[r, 7, c])


@kernel
def outputs45_adjoint(dy, points, first, last):
    """points = A dY A^T of every 4x4 block of dy (n, 4 th, 4 tw, K), outputs45's adjoint,
    over the block's columns first, then over its rows."""
    _, h4, w4, k = dy.shape
    th, tw = h4 // 4, w4 // 4
    u = np.empty((4, 8, k), np.float32)
    for m in range(first, last):
        for i in range(th):
            for j in range(tw):
                t = (m * th + i) * tw + j
                for r in range(4):
                    y0, y1 = dy[m, 4 * i + r, 4 * j], dy[m, 4 * i + r, 4 * j + 1]
                    y2, y3 = dy[m, 4 * i + r, 4 * j + 2], dy[m, 4 * i + r, 4 * j + 3]
                    for c in range(k):
                        (u[r, 0, c], u[r, 1, c], u[r, 2, c], u[r, 3, c], u[r, 4, c],
                         u[r, 5, c], u[r, 6, c], u[r, 7, c]) = _outputs45_adjoint(
                            y0[c], y1[c], y2[c], y3[c])
                for s in range(8):
                    p0, p1, p2, p3 = points[s, t], points[8 + s, t], points[16 + s, t], \
                        points[24 + s, t]
                    p4, p5, p6, p7 = points[32 + s, t], points[40 + s, t], points[48 + s, t], \
                        points[56 + s, t]
                    for c in range(k):
                        p0[c], p1[c], p2[c], p3[c], p4[c], p5[c], p6[c], p7[c] = \
                            _outputs45_adjoint(u[0, s, c], u[1, s, c], u[2, s, c], u[3, s, c])
