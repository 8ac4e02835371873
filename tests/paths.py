"""Paths of the files the repository keeps for its tests, named here once."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Real Caffe files (nets, weights, solver states), copied with their origins in its README.md.
CAFFE_FIXTURES = TESTS / "fixtures" / "caffe"
