"""Fuzzing the prototxt and solver readers with mutations of real files.

Every mutated net (built in both phases, one forward and backward) and every mutated solver
(two training steps on a tiny net) must either work or end in one SyncSGDError whose message is
a single line naming the file, field or layer: never a traceback from numpy, protobuf or Python,
never a hang, never a runaway allocation. The cases are seeded, so a failure names a case that
reproduces; they run in a worker process with an address-space limit, one case at a time, and
the worker is replaced when a case outlives its time.
"""
import json
import os
import random
import re
import resource
import selectors
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = os.path.join(ROOT, "tests", "zoo")
SEED = 18
CASE_SECONDS = 10             # CPU time a case may take (wall time varies with the load)
HANG_SECONDS = 60             # wall time after which a case counts as hung
CASE_BYTES = 1 << 30          # address space a case may add to the worker's
NUMBERS = ("0", "-1", "2", "100", "2147483648", "4294967295", "-2147483649", "1e30", "-1e30",
           "1e-30", "nan", "inf", "abc")
# In a solver 100 is work, not an error: iter_size or test_iter 100 takes seconds.
SOLVER_NUMBERS = tuple(n for n in NUMBERS if n != "100")

# (base name, path, rewrites, cases): real nets, made small enough to run in milliseconds.
# Sources and batch sizes are rewritten to the tiny HDF5 sets the fixture writes, the zoo's
# inputs to one small image; the two largest nets get fewer cases.
MTCNN = "tests/zoo/kpzhang93_MTCNN_face_detection_alignment/code/codes"
NETS = [
    ("lenet_train_val", "models/lenet/train_val.prototxt",
     [("data/digits/train.txt", "@digits"), ("data/digits/test.txt", "@digits"),
      ("batch_size: 64", "batch_size: 4"), ("batch_size: 100", "batch_size: 4")], 48),
    ("lenet_deploy", "models/lenet/deploy.prototxt", [], 30),
    ("cifar_train_val", "models/cifar10_quick/train_val.prototxt",
     [("data/cifar10/train.txt", "@cifar"), ("data/cifar10/test.txt", "@cifar"),
      ("batch_size: 100", "batch_size: 2")], 48),
    ("cifar_deploy", "models/cifar10_quick/deploy.prototxt", [], 30),
    ("mtcnn_det1", f"{MTCNN}/MTCNNv1/model/det1.prototxt", [], 36),
    ("mtcnn_det2", f"{MTCNN}/MTCNNv1/model/det2.prototxt", [], 36),
    ("mtcnn_det4", f"{MTCNN}/MTCNNv2/model/det4.prototxt", [], 36),
    ("cifar10_full", "tests/zoo/BVLC_caffe/examples/cifar10/cifar10_full.prototxt", [], 36),
    ("mnist_siamese", "tests/zoo/BVLC_caffe/examples/siamese/mnist_siamese.prototxt",
     [("dim: 10000", "dim: 2")], 36),
    ("squeezenet", "tests/zoo/DeepScale_SqueezeNet/SqueezeNet_v1.1/deploy.prototxt",
     [("dim: 10 dim: 3 dim: 227 dim: 227", "dim: 1 dim: 3 dim: 64 dim: 64")], 36),
    ("shufflenet_v2", "tests/zoo/farmingyard_ShuffleNet/shufflenet_v2_1x_deploy.prototxt",
     [("dim: 224\n  dim: 224", "dim: 64\n  dim: 64")], 18),
    ("mobilenet_ssd", "tests/zoo/chuanqi305_MobileNet-SSD/voc/MobileNetSSD_deploy.prototxt",
     [], 15),
    ("colorization", "tests/zoo/richzhang_colorization/models/colorization_deploy_v2.prototxt",
     [("dim: 1 dim: 1 dim: 224 dim: 224", "dim: 1 dim: 1 dim: 32 dim: 32")], 18),
    ("mobilenet", "tests/zoo/shicai_MobileNet-Caffe/mobilenet_deploy.prototxt",
     [("input_dim: 224\ninput_dim: 224", "input_dim: 64\ninput_dim: 64")], 18),
    ("densenet", "tests/zoo/shicai_DenseNet-Caffe/DenseNet_121.prototxt",
     [("input_dim: 224\ninput_dim: 224", "input_dim: 64\ninput_dim: 64")], 15),
]
# (base name, path, its net, rewrites, lines added): the real solvers, and variants of them with
# each update rule and learning-rate policy, so that mutations reach those fields too. Each
# trains two iterations and tests after the first.
LENET_SOLVER, CIFAR_SOLVER = "models/lenet/solver.prototxt", "models/cifar10_quick/solver.prototxt"
SOLVERS = [
    ("lenet_solver", LENET_SOLVER, "lenet_train_val", [], ""),
    ("cifar_solver", CIFAR_SOLVER, "cifar_train_val", [],
     ('type: "Adam"\nmomentum2: 0.999\ndelta: 1e-8\niter_size: 1\naverage_loss: 1\n'
      'clip_gradients: 10\nregularization_type: "L2"\n')),
    ("rmsprop_solver", LENET_SOLVER, "lenet_train_val",
     [('lr_policy: "inv"', 'lr_policy: "step"\nstepsize: 1')],
     'type: "RMSProp"\nrms_decay: 0.98\ndelta: 1e-8\nclip_gradients: 1\n'),
    ("nesterov_solver", LENET_SOLVER, "lenet_train_val",
     [('lr_policy: "inv"', 'lr_policy: "multistep"\nstepvalue: 1\nstepvalue: 2')],
     'type: "Nesterov"\nsnapshot_after_train: false\n'),
    ("adadelta_solver", CIFAR_SOLVER, "cifar_train_val",
     [('lr_policy: "fixed"', 'lr_policy: "poly"\npower: 2'), ("momentum: 0.9", "momentum: 0.95")],
     'type: "AdaDelta"\ndelta: 1e-6\niter_size: 2\n'),
    ("adagrad_solver", CIFAR_SOLVER, "cifar_train_val",
     [('lr_policy: "fixed"', 'lr_policy: "sigmoid"\ngamma: -0.1\nstepsize: 1'),
      ("momentum: 0.9\n", "")],
     'type: "AdaGrad"\ndelta: 1e-8\nregularization_type: "L1"\n'),
]
SOLVER_CASES = 30             # mutations per solver file
CLI_CASES = 6


# -- mutations --------------------------------------------------------------------------------

def _lines(text):
    return text.split("\n")


def delete_line(text, rng):
    lines = _lines(text)
    i = rng.randrange(len(lines))
    return f"delete line {i + 1}", "\n".join(lines[:i] + lines[i + 1:])


def duplicate_line(text, rng):
    lines = _lines(text)
    i = rng.randrange(len(lines))
    return f"duplicate line {i + 1}", "\n".join(lines[:i + 1] + lines[i:])


_VALUE = re.compile(r"(\b\w+:\s*)(\"[^\"\n]*\"|[-+\w.]+)")


def extreme_value(text, rng, numbers=NUMBERS):
    """A field's value replaced: numbers by extremes, quoted strings and enum names by others of
    the file (another layer type, blob or enum value) or by nonsense."""
    matches = list(_VALUE.finditer(text))
    m = rng.choice(matches)
    old = m.group(2)
    if old[0] == '"':
        others = [v.group(2) for v in matches if v.group(2)[0] == '"']
        value = rng.choice(others + ['"abc"', '""', "abc"])
    elif old[0].isalpha():
        others = [v.group(2) for v in matches if v.group(2)[0].isalpha()]
        value = rng.choice(others + ["abc", "0"])
    else:
        value = rng.choice(numbers)
    return (f"{m.group(1).strip()} {value} at offset {m.start()}",
            text[:m.start(2)] + value + text[m.end(2):])


def solver_value(text, rng):
    return extreme_value(text, rng, SOLVER_NUMBERS)


def unbalance_brace(text, rng):
    braces = [i for i, c in enumerate(text) if c in "{}"]
    if rng.random() < 0.5 and braces:
        i = rng.choice(braces)
        return f"drop '{text[i]}' at offset {i}", text[:i] + text[i + 1:]
    i = rng.randrange(len(text) + 1)
    brace = rng.choice("{}")
    return f"add '{brace}' at offset {i}", text[:i] + brace + text[i:]


def truncate(text, rng):
    i = rng.randrange(len(text))
    return f"truncate at {i}", text[:i]


def flip_bytes(text, rng):
    """1 to 3 bytes changed; half the time to other ASCII, which the parser reads further."""
    data = bytearray(text.encode())
    where = sorted(rng.randrange(len(data)) for _ in range(rng.randint(1, 3)))
    top = rng.choice((128, 256))
    for i in where:
        data[i] = (data[i] ^ rng.randrange(1, top)) % 256
    return f"flip bytes at {where}", bytes(data)


def cycle(text, rng):
    """A layer whose first bottom is its own top, or a later layer's top."""
    from syncsgd.compile import top_level_entries
    layers = [e for e in top_level_entries(text) if e.field in ("layer", "layers")]
    spans = [(e.start, e.end, re.findall(r'top:\s*"([^"]+)"', text[e.start:e.end]))
             for e in layers]
    readers = [k for k, (s, e, tops) in enumerate(spans)
               if tops and re.search(r'bottom:\s*"', text[s:e])]
    k = rng.choice(readers)
    later = [t for _, _, tops in spans[k + 1:] for t in tops]
    own = rng.random() < 0.5 or not later
    top = rng.choice(spans[k][2] if own else later)
    start, end, _ = spans[k]
    body = re.sub(r'bottom:\s*"[^"]+"', f'bottom: "{top}"', text[start:end], count=1)
    what = "its own top" if own else "a later top"
    return f"layer {k} reads {what} '{top}'", text[:start] + body + text[end:]


NET_MUTATIONS = (delete_line, duplicate_line, extreme_value, extreme_value, extreme_value,
                 extreme_value, unbalance_brace, truncate, flip_bytes, cycle)
SOLVER_MUTATIONS = (delete_line, duplicate_line, solver_value, solver_value, solver_value,
                    unbalance_brace, truncate, flip_bytes)


def mutate(text, mutations, count, rng):
    """`count` (label, text or bytes) mutations of `text`; the first are truncations at the
    very start and end."""
    cases = [("truncate at 0", ""), (f"truncate at {len(text) - 1}", text[:-1])]
    while len(cases) < count:
        cases.append(rng.choice(mutations)(text, rng))
    return cases


# -- the cases, run in a worker ---------------------------------------------------------------

def run_net(path):
    from syncsgd import TEST, TRAIN, Net
    for phase in (TRAIN, TEST):
        net = Net(path, phase)
        try:
            net.forward()
            if phase == TRAIN:
                net.backward()
        finally:
            net.close()


def run_solver(path):
    from syncsgd import get_solver
    solver = get_solver(path)
    try:
        solver.step(2)
    finally:
        solver.close()


def outcome(kind, path):
    """{"ok": True} or the error: its class, message and (for a non-SyncSGDError) traceback."""
    from syncsgd.errors import SyncSGDError
    start = time.process_time()
    try:
        (run_net if kind == "net" else run_solver)(path)
        result = {"ok": True}
    except SyncSGDError as e:
        result = {"ok": False, "error": type(e).__name__, "message": str(e)}
    except BaseException as e:  # noqa: BLE001  (any other exception is the defect looked for)
        result = {"ok": False, "error": type(e).__name__, "message": str(e),
                  "traceback": traceback.format_exc(limit=-4)}
    result["seconds"] = time.process_time() - start
    result["vm"] = address_space()
    result["threads"] = sorted(t.name for t in threading.enumerate()
                               if t is not threading.main_thread())
    return result


def address_space():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def worker():
    """Read case JSON lines on stdin and answer one JSON line each; each case may map
    CASE_BYTES more than the worker held before it (caches of earlier cases, such as oneDNN's
    primitives, are not the case's)."""
    import syncsgd  # noqa: F401
    from syncsgd import log
    log.LOGGER.setLevel("ERROR")
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    for line in sys.stdin:
        case = json.loads(line)
        resource.setrlimit(resource.RLIMIT_AS, (address_space() + CASE_BYTES, hard))
        print(json.dumps(outcome(case["kind"], case["path"])), flush=True)


class Worker:
    """A worker process; `run(case)` gives its answer, or None when it took too long or died
    (the worker is then replaced)."""

    def __init__(self, cwd):
        self.cwd = cwd
        self.proc = None

    def start(self):
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
                   OPENBLAS_NUM_THREADS="1", NUMEXPR_MAX_THREADS="1",
                   MALLOC_ARENA_MAX="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.test_fuzz_readers"],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)
        self.run({"kind": "net", "path": os.path.join(ROOT, NETS[1][1])}, startup=True)

    def run(self, case, startup=False):
        if self.proc is None:
            self.start()
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        limit = HANG_SECONDS * (2 if startup else 1)
        if self.selector.select(timeout=limit):
            line = self.proc.stdout.readline()
            if line:
                return json.loads(line)
        self.stop()
        return None

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


# -- fixtures ---------------------------------------------------------------------------------

def write_set(directory, name, shape, rows=8):
    import h5py
    rng = np.random.default_rng(0)
    h5 = os.path.join(directory, f"{name}.h5")
    with h5py.File(h5, "w") as f:
        f["data"] = rng.random((rows,) + shape, dtype=np.float32)
        f["label"] = (np.arange(rows) % 10).astype(np.float32)
    listing = os.path.join(directory, f"{name}.txt")
    with open(listing, "w") as f:
        f.write(h5 + "\n")
    return listing


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return write_bases(str(tmp_path_factory.mktemp("bases")))


def write_bases(directory):
    """{name: text} of the base net and solver files, rewritten to run on tiny data in
    `directory`."""
    sets = {"@digits": write_set(directory, "digits", (1, 28, 28)),
            "@cifar": write_set(directory, "cifar", (3, 32, 32))}
    texts = {}
    for name, path, rewrites, _ in NETS:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for old, new in rewrites:
            assert old in text, (path, old)
            text = text.replace(old, sets.get(new, new))
        texts[name] = text
    for name, path, net, rewrites, extra in SOLVERS:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        net_path = os.path.join(directory, f"{net}.prototxt")
        with open(net_path, "w") as f:
            f.write(texts[net])
        for pattern, value in ((r'net: "[^"]*"', f'net: "{net_path}"'),
                               (r"test_iter: \d+", "test_iter: 2"),
                               (r"test_interval: \d+", "test_interval: 1"),
                               (r"display: \d+", "display: 1"), (r"max_iter: \d+", "max_iter: 2"),
                               (r"snapshot: \d+", "snapshot: 0"),
                               (r'snapshot_prefix: "[^"]*"', 'snapshot_prefix: "@prefix"'),
                               (r'type: "SGD"\n', "")):
            text = re.sub(pattern, value, text)
        for old, new in rewrites:
            assert old in text, (name, old)
            text = text.replace(old, new)
        texts[name] = text + extra + "test_initialization: false\n"
    return texts


def write_case(directory, index, base, data):
    """The case's file (solver snapshot prefixes get a directory of their own)."""
    path = os.path.join(directory, f"case{index:04d}-{base}.prototxt")
    if isinstance(data, str):
        data = data.encode()
    data = data.replace(b"@prefix", os.path.join(directory, f"snap{index}", "s").encode())
    with open(path, "wb") as f:
        f.write(data)
    return path


def cases(bases, directory):
    rng = random.Random(SEED)
    out = []
    for name, _, _, count in NETS:
        for label, data in mutate(bases[name], NET_MUTATIONS, count, rng):
            out.append(("net", name, label, data))
    for name, *_ in SOLVERS:
        for label, data in mutate(bases[name], SOLVER_MUTATIONS, SOLVER_CASES, rng):
            out.append(("solver", name, label, data))
    return [{"kind": kind, "base": base, "label": label,
             "path": write_case(directory, i, base, data)}
            for i, (kind, base, label, data) in enumerate(out)]


def schema_fields():
    """Every field name of the net and solver schemas."""
    from syncsgd.proto import pb
    names, seen, todo = set(), set(), [pb.NetParameter.DESCRIPTOR, pb.SolverParameter.DESCRIPTOR]
    while todo:
        message = todo.pop()
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        for field in message.fields:
            names.add(field.name)
            if field.message_type is not None:
                todo.append(field.message_type)
    return names


FIELDS = schema_fields()


def names_something(message):
    """Whether an error message names a file (a path), a layer or a field."""
    if "layer '" in message or re.search(r"/\S+|\w\.(prototxt|txt|h5)\b", message):
        return True
    return any(word.split(".")[-1] in FIELDS for word in re.findall(r"[\w.]+", message))


def defect(result):
    """What is wrong with a case's result, or None."""
    if result is None:
        return f"no answer within {HANG_SECONDS} s (a hang, or the worker died)"
    if result["seconds"] > CASE_SECONDS:
        return f"took {result['seconds']:.1f} s of CPU time"
    if result["ok"]:
        return None
    message = result["message"]
    if "traceback" in result:
        return f"{result['error']}: {message}\n{result['traceback']}"
    if "\n" in message or not message.strip():
        return f"{result['error']} message is not one line: {message!r}"
    if not names_something(message):
        return f"{result['error']} names no file, layer or field: {message!r}"
    return None


def run_cases(selected, directory):
    """[(case, result)] of the cases, and the defects found, one line of context each."""
    worker, results, failures = Worker(directory), [], []
    try:
        for case in selected:
            result = worker.run(case)
            results.append((case, result))
            problem = defect(result)
            if problem:
                failures.append(f"{os.path.basename(case['path'])} ({case['label']}): {problem}")
    finally:
        worker.stop()
    return results, failures


@pytest.fixture(scope="module")
def outcomes(bases, tmp_path_factory):
    """run_cases of every case."""
    directory = str(tmp_path_factory.mktemp("cases"))
    return run_cases(list(cases(bases, directory)), directory)


def test_every_mutation_builds_or_fails_in_one_line(outcomes):
    results, failures = outcomes
    errors = sum(1 for _, r in results if r and not r["ok"])
    print(f"{len(results)} cases: {len(results) - errors} built or trained, {errors} errors, "
          f"{len(failures)} defects")
    assert len(results) > 600 and errors > 100 and len(results) - errors > 100
    assert not failures, "\n".join(failures)


def test_impossible_iter_size_fails_in_one_line(bases, tmp_path):
    selected = [{"kind": "solver", "base": "cifar_solver", "label": f"iter_size: {value}",
                  "path": write_case(str(tmp_path), 9000 + k, "cifar_solver",
                                     bases["cifar_solver"].replace("iter_size: 1",
                                                                   f"iter_size: {value}"))}
                 for k, value in enumerate((0, -1))]
    _, failures = run_cases(selected, str(tmp_path))
    assert not failures, "\n".join(failures)


# Mutations that once ended in a traceback: (base, text, its replacement, a part of the error
# message, or None where the net now builds and runs).
REGRESSIONS = [
    ("lenet_deploy", "num_output: 500", "num_output: 2147483648", "a blob may hold"),
    ("lenet_deploy", "kernel_size: 5", "kernel_size: 2147483648", "output size"),
    ("lenet_deploy", "kernel_size: 5", "kernel_size: 1000", "output size"),
    ("lenet_deploy", "dim: 1 dim: 1 dim: 28 dim: 28",
     "dim: 1 dim: 1 dim: 4294967296 dim: 4294967296", "a blob may hold"),
    ("lenet_deploy", "dim: 1 dim: 1 dim: 28", "dim: 1 dim: 0 dim: 28", "has no channels"),
    ("lenet_deploy", "dim: 1 dim: 1 dim: 28", "dim: 0 dim: 1 dim: 28", None),
    ("cifar10_full", "local_size: 3", "local_size: 4294967295", "lrn_param.local_size"),
    ("mobilenet_ssd", "max_size: 150.0", "max_size: nan", "prior_box_param max_size"),
    ("mobilenet_ssd", "aspect_ratio: 2.0", "aspect_ratio: 0", "give positive values"),
    ("cifar_deploy", "std: 0.0001", "std: -1", "layer 'conv1': gaussian filler has std: -1"),
    ("cifar_deploy", "std: 0.0001", "std: nan", "give a finite number"),
    ("lenet_solver", "power: 0.75", "power: -2147483649", "no finite learning rate"),
    ("lenet_solver", "gamma: 0.0001", "gamma: -1", "no finite learning rate"),
    ("cifar_solver", "momentum2: 0.999", "momentum2: 2", "Adam needs momentum"),
    ("cifar_solver", "momentum: 0.9", "momentum: -1", "Adam needs momentum"),
]


def test_former_tracebacks_are_one_line_errors(bases, tmp_path):
    selected = []
    for k, (base, old, new, _) in enumerate(REGRESSIONS):
        assert old in bases[base], (base, old)
        kind = "solver" if base.endswith("_solver") else "net"
        selected.append({"kind": kind, "base": base, "label": new, "path": write_case(
            str(tmp_path), k, base, bases[base].replace(old, new, 1))})
    results, failures = run_cases(selected, str(tmp_path))
    assert not failures, "\n".join(failures)
    for (case, result), (_, _, _, expected) in zip(results, REGRESSIONS):
        if expected is None:
            assert result["ok"], (case["label"], result)
        else:
            assert not result["ok"] and expected in result["message"], (case["label"], result)


def test_train_command_prints_one_error_line(outcomes, tmp_path):
    """`syncsgd train --solver <mutated>` on a sample of the solver cases that fail, half of them
    in parsing and half later (a net, a learning rate, a NaN): exit status 1 and one line saying
    what, no traceback."""
    parse, later, kinds = [], [], set()
    for case, result in outcomes[0]:
        if case["kind"] != "solver" or result is None or result["ok"]:
            continue
        kind = (result["error"], result["message"].split(":")[-1][:12])
        if kind not in kinds:
            kinds.add(kind)
            parsing = re.search(r"\.prototxt:\d+:\d+: ", result["message"])
            (parse if parsing else later).append((case, result))
    sample = parse[:CLI_CASES // 2] + later[:CLI_CASES // 2]
    assert len(sample) == CLI_CASES
    for case, result in sample:
        run = subprocess.run([sys.executable, "-m", "syncsgd.cli", "train", "--solver",
                              case["path"]], check=False, cwd=str(tmp_path),
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=ROOT))
        lines = [line for line in run.stderr.splitlines() if "error" in line.lower()]
        assert run.returncode == 1, (case["label"], run.stderr[-2000:])
        assert "Traceback" not in run.stderr, (case["label"], run.stderr[-2000:])
        assert lines == [f"syncsgd train: error: {result['message']}"], (case["label"], lines)


if __name__ == "__main__":
    worker()
