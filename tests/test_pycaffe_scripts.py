"""Scripts written the way Caffe's example notebooks use pycaffe (tests/pycaffe/), whose only
change from pycaffe code is `import syncsgd as caffe`: each runs in a fresh folder and asserts
what it computes (accuracies, equal outputs, falling losses)."""
import os
import subprocess
import sys

import pytest

from tests.paths import CAFFE_FIXTURES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = os.path.join(HERE, "pycaffe")
LENET = os.path.join(CAFFE_FIXTURES, "weights", "lenet-ethereon")

pytest.importorskip("sklearn")
pytest.importorskip("PIL")


@pytest.mark.parametrize("script, args", [
    ("classify.py", [LENET]),
    ("learn_lenet.py", []),
    ("net_surgery.py", [LENET]),
    ("fine_tune.py", [LENET]),
    ("python_layers.py", []),
])
def test_pycaffe_style_script(tmp_path, script, args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *args],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{script}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.stdout.rstrip().endswith("ok")
