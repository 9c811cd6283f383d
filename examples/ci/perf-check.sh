#!/usr/bin/env bash
# Benchmark a baseline and a candidate, then fail (exit 1) if any cell regressed.
#
# Each side is a checkout of the code to measure (BASE_DIR, CAND_DIR: moebench's own engines run from
# the checkout they are in) plus an optional set-up command that installs the build to measure
# (BASE_SETUP, CAND_SETUP, e.g. `pip install --force-reinstall ./wheels/llama_cpp_python-base.whl`).
# The two sweeps run one after the other with the same settings; compare judges every cell
# (a 1 - ALPHA interval of each ratio that excludes 1, and a THRESHOLD change, see docs/ci.md) and writes
# compare.md for a PR comment.
#
# Settings (environment):      default
#   PYTHON                      python3      the interpreter with moebench's dependencies
#   BASE_DIR / CAND_DIR         .            checkouts to benchmark
#   BASE_SETUP / CAND_SETUP     (none)       shell commands run before each side's sweep
#   MODEL                       preset:tiny  -m (a GGUF path or preset:NAME; use your real model)
#   ENGINE                      llama-cpp    -e
#   DEPTHS                      0            --n-cpu-moe list
#   WORKLOADS                   pp512,tg64   -w
#   REPS                        10           -r, spread over the rounds
#   ROUNDS                      5            --rounds: fresh processes per side, the units of the interval
#                                            (one process per side gives no verdict; 3 is the least that does)
#   THREADS                     (all cores)  --threads
#   SWEEP_ARGS                  (none)       more sweep flags for both sides
#   CAND_ARGS                   (none)       sweep flags for the candidate only
#   COMPARE_ARGS                (none)       more compare flags (e.g. --ignore n_ubatch)
#   THRESHOLD / ALPHA           5% / 0.05
#   RESULTS                     results/ci   where both runs, history.sqlite and compare.md go
set -euo pipefail

PYTHON=${PYTHON:-python3}
RESULTS=$(mkdir -p "${RESULTS:-results/ci}" && cd "${RESULTS:-results/ci}" && pwd)
# --sample-ms 0: no memory sampler thread competing with the timed work
args=(-m "${MODEL:-preset:tiny}" -e "${ENGINE:-llama-cpp}" --n-cpu-moe "${DEPTHS:-0}" -w "${WORKLOADS:-pp512,tg64}"
      -r "${REPS:-10}" --rounds "${ROUNDS:-5}" --sample-ms 0 --results-dir "$RESULTS")
[[ -n "${THREADS:-}" ]] && args+=(--threads "$THREADS")

sweep() {   # sweep DIR SETUP EXTRA_ARGS -> prints the run directory
    local dir=$1 setup=$2 extra=$3
    [[ -n "$setup" ]] && (cd "$dir" && bash -c "$setup") >&2
    # the sweep's table goes to the log (stderr); its last line "results: DIR" names the run
    (cd "$dir" && "$PYTHON" -m harness sweep "${args[@]}" ${SWEEP_ARGS:-} $extra) 2>&1 >&2 | tee /dev/stderr |
        sed -n 's/^results: //p' | tail -n 1
}

echo "== baseline (${BASE_DIR:-.})" >&2
base=$(sweep "${BASE_DIR:-.}" "${BASE_SETUP:-}" "")
echo "== candidate (${CAND_DIR:-.})" >&2
cand=$(sweep "${CAND_DIR:-.}" "${CAND_SETUP:-}" "${CAND_ARGS:-}")

status=0
(cd "${CAND_DIR:-.}" && "$PYTHON" -m harness compare "$base" "$cand" --threshold "${THRESHOLD:-5%}" \
    --alpha "${ALPHA:-0.05}" --results-dir "$RESULTS" --fail-on-regression --format md -o "$RESULTS/compare.md" \
    ${COMPARE_ARGS:-}) || status=$?
cat "$RESULTS/compare.md"
[[ -n "${GITHUB_STEP_SUMMARY:-}" && -f "$RESULTS/compare.md" ]] && cat "$RESULTS/compare.md" >> "$GITHUB_STEP_SUMMARY"
case $status in
    0) echo "moebench: no regression" >&2 ;;
    1) echo "moebench: performance regression (see compare.md)" >&2 ;;
    *) echo "moebench: compare failed with exit code $status" >&2 ;;
esac
exit "$status"
