"""Data input: HDF5 sources read by row, Caffe's transforms, mean files, background prefetch."""
from syncsgd.io.hdf5 import H5Source, read_list
from syncsgd.io.mean import load_mean, save_mean
from syncsgd.io.prefetch import Prefetcher
from syncsgd.io.transform import Transformer

__all__ = ["H5Source", "Prefetcher", "Transformer", "load_mean", "read_list", "save_mean"]
