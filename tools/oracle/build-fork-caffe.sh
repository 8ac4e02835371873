#!/usr/bin/env bash
# Builds the SSD-era fork of Caffe in PyPI's brocolli-caffe 9.0.2 sdist as a reference oracle for
# the fork layers BVLC lacks (Proposal, SmoothL1Loss, MultiBoxLoss, AnnotatedData, DetectionOutput,
# ReLU6, ...; its PSROIPooling has no CPU code). CPU only, OpenBLAS, LMDB and LevelDB, no OpenCV
# (only encoded images need it); its net.cpp includes gtest's header. The sdist builds only pycaffe
# (no `caffe` tool), in a Python 3.11 venv of its own (numpy < 2). About 30 minutes on 2 busy
# cores; a second call only prints the env file, an interrupted one resumes.
#
#   source "$(bash tools/oracle/build-fork-caffe.sh)"
#   python -c "import caffe; print(caffe.layer_type_list())"
#
# The sdist comes from PyPI (pip download --no-deps --no-binary :all: brocolli-caffe==9.0.2);
# BROCOLLI_SDIST=path/to/brocolli-caffe-9.0.2.tar.gz skips the download.
# Not for CI or the test suite's default run: tests that compare against it skip without it.
set -euo pipefail
OUT=${FORK_ORACLE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/brocolli-caffe-9.0.2}
ENVF=$OUT/env.sh
if [[ -f $ENVF ]] && bash -c "source '$ENVF' && python -c 'import caffe'" >/dev/null 2>&1; then
  echo "$ENVF"; exit 0
fi
mkdir -p "$OUT"; LOG=$OUT/build.log; : > "$LOG"
say() { echo "build-fork-caffe: $*" >&2; }
say "building in $OUT (log: $LOG)"
export DEBIAN_FRONTEND=noninteractive
apt-get update >>"$LOG" 2>&1
apt-get install -y --no-install-recommends cmake build-essential pkg-config python3-dev \
  python3-venv \
  libboost-system-dev libboost-thread-dev libboost-filesystem-dev libboost-regex-dev \
  libboost-python-dev libgoogle-glog-dev libgflags-dev libprotobuf-dev protobuf-compiler \
  libhdf5-dev liblmdb-dev libleveldb-dev libsnappy-dev libopenblas-dev libgtest-dev >>"$LOG" 2>&1
PY=/usr/bin/python3
[[ -x $OUT/venv/bin/python ]] || $PY -m venv "$OUT/venv" >>"$LOG" 2>&1
"$OUT/venv/bin/pip" install -q "numpy<2" "protobuf>=4.21,<5" scipy scikit-image six h5py \
  >>"$LOG" 2>&1
SDIST=${BROCOLLI_SDIST:-}
if [[ -z $SDIST ]]; then
  "$OUT/venv/bin/pip" download -q --no-deps --no-binary :all: -d "$OUT" brocolli-caffe==9.0.2 \
    >>"$LOG" 2>&1
  SDIST=$OUT/brocolli-caffe-9.0.2.tar.gz
fi
# An interrupted build resumes: the sources are unpacked once and make picks up where it was.
if [[ ! -f $OUT/src/CMakeLists.txt ]]; then
  mkdir -p "$OUT/src" && tar xzf "$SDIST" -C "$OUT/src" --strip-components=1
fi
PYVER=$("$OUT/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# Its CMake expects a conda prefix and links plain -lboost_python -lhdf5 -lhdf5_hl; Debian names
# them boost_python3XX and hdf5_serial: a directory of links gives the names it asks for.
SHIM=$OUT/shim; rm -rf "$SHIM"; mkdir -p "$SHIM"
ARCH=/usr/lib/x86_64-linux-gnu
ln -s "$ARCH/libboost_python${PYVER/./}.so" "$SHIM/libboost_python.so"
ln -s "$ARCH/hdf5/serial/libhdf5.so" "$SHIM/libhdf5.so"
ln -s "$ARCH/hdf5/serial/libhdf5_hl.so" "$SHIM/libhdf5_hl.so"
mkdir -p "$OUT/build"
FLAGS="-O2 -DUSE_LMDB -DUSE_LEVELDB -I/usr/include/python$PYVER -I/usr/include/hdf5/serial"
(cd "$OUT/build" && cmake "$OUT/src" -DCMAKE_BUILD_TYPE=Release -DANACONDA_HOME="$OUT/venv" \
  -DPYTHON_VERSION="python$PYVER" -DCMAKE_CXX_FLAGS="$FLAGS" \
  -DCMAKE_SHARED_LINKER_FLAGS="-L$SHIM -Wl,--no-as-needed -llmdb -lleveldb -lgflags" \
  >>"$LOG" 2>&1)
make -C "$OUT/build" -j"$(nproc)" pycaffe >>"$LOG" 2>&1 ||
  { say "build failed: tail of $LOG:"; tail -20 "$LOG" >&2; exit 1; }
cat > "$ENVF" <<ENV
# brocolli-caffe 9.0.2 (SSD-era Caffe fork; CPU, OpenBLAS): \`import caffe\` in its own venv.
source "$OUT/venv/bin/activate"
export PYTHONPATH="$OUT/src/python\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$ARCH/hdf5/serial\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
ENV
bash -c "source '$ENVF' && python -c 'import caffe'" >>"$LOG" 2>&1 ||
  { say "built, but caffe does not import: see $LOG"; exit 1; }
say "done"
echo "$ENVF"
