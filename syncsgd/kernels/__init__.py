"""Compute kernels the layers call: GEMM and the thread pool (blas), im2col/col2im and scratch
buffers (im2col), and the oneDNN binding (onednn). Nothing here knows about layers or nets."""
