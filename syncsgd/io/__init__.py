"""Data input: HDF5 / LMDB sources read by row, Caffe's DataTransformer, mean files, background
prefetch; and pycaffe's caffe.io (Transformer, load_image, converters), so that
`syncsgd.io` is what `caffe.io` is to pycaffe scripts."""
from syncsgd.io.blobproto import (array_to_blobproto, array_to_datum,
                                  arraylist_to_blobprotovector_str, blobproto_to_array,
                                  blobprotovector_str_to_arraylist, datum_to_array)
from syncsgd.io.hdf5 import H5Source, read_list
from syncsgd.io.images import load_image, oversample, resize_image
from syncsgd.io.mean import load_mean, save_mean
from syncsgd.io.prefetch import Prefetcher
from syncsgd.io.preprocess import Transformer
from syncsgd.io.transform import DataTransformer

__all__ = ["DataTransformer", "H5Source", "Prefetcher", "Transformer", "array_to_blobproto",
           "array_to_datum", "arraylist_to_blobprotovector_str", "blobproto_to_array",
           "blobprotovector_str_to_arraylist", "datum_to_array", "load_image", "load_mean",
           "oversample", "read_list", "resize_image", "save_mean"]
