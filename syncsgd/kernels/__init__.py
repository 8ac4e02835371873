"""Compute kernels the layers call, and the one place that picks them.

plans: plan_convolution / plan_pooling and THRESHOLDS, which decide per layer geometry what runs;
convolution: the convolution kernels a plan names; blas: GEMM and the thread pool; im2col:
im2col/col2im and the row lowering; scratch: the buffers all layers share; onednn: the oneDNN
binding; threads: the process's thread budget; elementwise: sums and copies of whole arrays.
Nothing here knows about nets.
"""
