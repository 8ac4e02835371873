#!/usr/bin/env python3
"""Training speed of two syncsgd source trees (two commits), in turns, as docs/performance.md
asks for a before/after figure on a shared machine.

    git worktree add /tmp/before HEAD~1
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tools/compare.py /tmp/before . \\
        --model cddnn --pairs 8
    python tools/compare.py . . --env SYNCSGD_LANES=0 --model lenet     # a setting, same tree

Each run is one `tools/benchmark.py --no-torch --json` process of the tree's own code
(PYTHONPATH set to the tree), so the two never share a process; the trees take turns, the one
going first alternating from pair to pair. Printed per run and, at the end, per side: the
median images/s, update ms and fraction of the GEMM rate, and the ratio of the medians (after
over before). `--env NAME=VALUE` sets a variable for the second side only, to compare a setting.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def run(tree, model, benchmark_args, env):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), **env)
    command = [sys.executable, os.path.join(tree, "tools", "benchmark.py"), "--model", model,
               "--no-torch", "--json"] + benchmark_args
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"compare: {' '.join(command)} failed in {tree}:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout)[0]["frameworks"]["syncsgd"]
    return result["images_per_s"], result["update_ms"], result["fraction_of_gemm"]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="source tree of the first side (a worktree)")
    parser.add_argument("after", help="source tree of the second side")
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--env", action="append", default=[],
                        help="NAME=VALUE for the second side's runs (repeatable)")
    args, benchmark_args = parser.parse_known_args(argv)
    extra = dict(item.split("=", 1) for item in args.env)
    sides = [("before", args.before, {}), ("after", args.after, extra)]
    results = {name: [] for name, _, _ in sides}
    for pair in range(args.pairs):
        for name, tree, env in (sides if pair % 2 == 0 else sides[::-1]):
            speed, update, fraction = run(tree, args.model, benchmark_args, env)
            results[name].append((speed, update, fraction))
            print(f"{name}: {speed:.1f} images/s, update {update:.0f} ms, "
                  f"{100 * fraction:.0f}% of GEMM", flush=True)
    medians = {name: [statistics.median(r[i] for r in rows) for i in range(3)]
               for name, rows in results.items()}
    for name, (speed, update, fraction) in medians.items():
        print(f"{name} median: {speed:.1f} images/s, update {update:.1f} ms, "
              f"{100 * fraction:.0f}% of GEMM ({args.model}, {args.pairs} runs)")
    print(f"after / before: {medians['after'][0] / medians['before'][0]:.3f}x images/s")


if __name__ == "__main__":
    main()
