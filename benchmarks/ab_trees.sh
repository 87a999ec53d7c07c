#!/usr/bin/env bash
# A/B timing of a code change: the working tree against an earlier commit, in alternating processes on one GPU
# (two versions of the kernels cannot be timed in one process).
#
# Here (the tree with git):   bash benchmarks/ab_trees.sh prepare [REV]    # REV: default HEAD
#   writes REV's package, benchmarks and tests to scratch/ab_base (git-ignored; carry "scratch" to the device)
# On the GPU machine:         bash benchmarks/ab_trees.sh run [ROUNDS] [LENGTHS]
#   alternates base and working tree ROUNDS times (default 2), each a `benchmarks/ops.py` run of the NHA kernels
#   alone at LENGTHS (default 32768,8192), and prints one line per measurement, tagged base or new.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=scratch/ab_base
case "${1:-}" in
  prepare)
    rm -rf "$BASE" && mkdir -p "$BASE"
    git archive "${2:-HEAD}" nha_retrofit benchmarks tests | tar -x -C "$BASE"
    echo "$BASE: $(git rev-parse --short "${2:-HEAD}")"
    ;;
  run)
    [ -d "$BASE" ] || { echo "no $BASE: run 'prepare' where the git history is, and carry scratch"; exit 2; }
    OUT=${OUT:-$(mktemp -d)}
    args=(--lengths "${3:-32768,8192}" --skip nha_graph,sdpa,fla_window,fla_gsa,decode)
    timed() {  # timed TAG TREE: one ops.py process in TREE, its NHA lines tagged
      (cd "$2" && PYTHONPATH=$PWD:$PWD/tests timeout 200 python3 benchmarks/ops.py "${args[@]}" --out-dir "$OUT/$1" 2>&1 |
        grep "^nha " | sed "s/^/$1 /")
    }
    for _ in $(seq "${2:-2}"); do timed base "$BASE"; timed new .; done
    ;;
  *)
    echo "usage: bash benchmarks/ab_trees.sh prepare [REV] | run [ROUNDS] [LENGTHS]"; exit 2
    ;;
esac
