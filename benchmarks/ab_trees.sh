# Sourced by the A/B harnesses (run_decode_on_gpu.sh, run_gemm_on_gpu.sh), run from a checkout:
#   source "$(dirname "$0")/ab_trees.sh"
# Tree A is that checkout; tree B is another one copied into it (B_TREE, a path relative to A's root). /tmp/a and /tmp/b
# hold each as the package `splitserve` (PYTHONPATH=/tmp/a or /tmp/b). Sets out ($OUT, where the call's files go),
# b, log ($out/log.txt) and `mark NAME`, which logs a stage's start with the seconds since this was sourced.
out=${OUT:?}
b=${B_TREE:?B_TREE: the tree to compare, relative to this checkout}
log=$out/log.txt
t0=$(date +%s)
mark() { echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a "$log"; }
mkdir -p /tmp/a /tmp/b && ln -sfn "$PWD" /tmp/a/splitserve && ln -sfn "$PWD/$b" /tmp/b/splitserve
export PYTHONUNBUFFERED=1
