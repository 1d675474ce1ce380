#!/usr/bin/env bash
# The GPU device check, in two commands of at most 6 minutes each (the limits below add up to 360 s
# per command, the CUDA check's 30 s included), so that both fit a lent GPU's 15 minutes with its start-up:
#   bash benchmarks/gpu_check.sh 1 [--out DIR]   what matters most (docs/gpu-status.md):
#     acceptance ddp, resume, fsdp, syncs (160 s); deferred construction, test_large_model.py (55 s);
#     tensor parallel, test_tensor_parallel.py (115 s)
#   bash benchmarks/gpu_check.sh 2 [--out DIR]   the rest:
#     the other CUDA tests of tests/gpu (110 s); acceptance precision, speed, plan, prefetch, processes,
#     compile, tune (220 s; those that would overrun are listed as not run)
#   bash benchmarks/gpu_check.sh [all] [--out DIR]   both, one after the other
# Each part runs under `timeout`, whatever the one before did; its verdict line is appended to
# DIR/command-N.txt as soon as it ends, and the acceptance tier rewrites DIR/acceptance-N.json after
# each of its parts, so a timeout loses nothing already done. DIR defaults to runs/gpu-check-<date>.
# Exit: 0 when every part passed; 1 when one failed or timed out; 3 when none failed but something
# did not run (a pytest part whose tests all skipped, acceptance parts left out); 1 at once without CUDA.
# PY picks the interpreter: default .venv/bin/python (make setup), else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 # the parts' progress shows as it happens, through tee
if [ -z "${PY:-}" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi

which=all
out=runs/gpu-check-$(date +%Y%m%d)
while [ $# -gt 0 ]; do
    case $1 in
    1 | 2 | all) which=$1 ;;
    --out) out=${2:?--out needs a directory} && shift ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [1|2|all] [--out DIR]" >&2 && exit 2 ;;
    esac
    shift
done

# CUDA first: with a CPU-only torch every CUDA test would skip and the check would prove nothing.
if ! seen=$(timeout 30 "$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available())' 2>&1); then
    echo "gpu_check.sh: no CUDA device: $PY cannot import torch ($(echo "$seen" | tail -n 1)); run make setup" >&2
    exit 1
fi
seen=$(echo "$seen" | tail -n 1) # "2.13.0+cpu False", after any warning torch printed
if [ "${seen##* }" != True ]; then
    echo "gpu_check.sh: no CUDA device: torch ${seen% *} sees none; run this on a machine with an NVIDIA GPU after make setup" >&2
    exit 1
fi

mkdir -p "$out"
rows=()
worst=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

pytest_figure() { # the counts of a pytest log: its final line, else (timed out) its -v status words
    local counts
    counts=$(grep -E '^=+ .* in [0-9.]+s' "$log" | tail -n 1 | grep -oE '[0-9]+ (passed|failed|skipped|errors?)')
    if [ -z "$counts" ]; then
        counts=$(for w in PASSED FAILED SKIPPED ERROR; do echo "$(grep -oE "\\b$w\\b" "$log" | wc -l) $w"; done)
        counts=$(echo "$counts" | tr 'A-Z' 'a-z' | grep -v '^0 ')
    fi
    echo "${counts:-0 passed}" | paste -sd, - | sed 's/,/, /g'
}

part() { # part KIND NAME LIMIT COMMAND...: run it under timeout, then its verdict line to the results
    local kind=$1 name=$2 limit=$3 started rc verdict figure code
    shift 3
    echo "== gpu_check.sh: $name (at most ${limit}s): $*"
    started=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if [ "$kind" = pytest ]; then figure=$(pytest_figure); else
        figure=$(grep -E '^gpu_check: [0-9]+ pass' "$log" | tail -n 1 | sed 's/^gpu_check: //')
        figure=${figure:-"no summary; see the JSON for the parts done"}
    fi
    case $rc in
    0) verdict=passed code=0 ;;
    124) verdict="timed out" code=1 ;;
    3) verdict="partly run" code=3 ;; # acceptance: parts left out by --time-limit
    5) verdict=skipped code=3 ;;      # pytest: no test collected
    *) verdict=failed code=1 ;;
    esac
    if [ "$kind" = pytest ] && [ "$rc" -eq 0 ] && ! echo "$figure" | grep -qE '(^|[^0-9])[1-9][0-9]* passed'; then
        verdict=skipped code=3 # every test skipped: nothing was checked
    fi
    if [ "$code" -eq 1 ] || { [ "$code" -eq 3 ] && [ "$worst" -eq 0 ]; }; then worst=$code; fi
    rows+=("$(printf '%-44s %-10s %4ss of %3ss  %s' "$name" "$verdict" "$(($(date +%s) - started))" "$limit" "$figure")")
    echo "${rows[-1]}" | tee -a "$results"
}

acceptance() { # acceptance N LIMIT PARTS: the acceptance tier, stopping its own parts 25 s before the limit
    part acceptance "acceptance: ${3//,/, }" "$2" "$PY" -m tests.gpu.acceptance.run --parts "$3" \
        --time-limit $(($2 - 25)) --out "$out/acceptance-$1.json"
}

pytest_part() { # pytest_part NAME LIMIT PATHS...: -v -rN: one status word per test, counted if it times out
    local name=$1 limit=$2
    shift 2
    part pytest "$name" "$limit" "$PY" -m pytest -v -s -rN -p no:cacheprovider -m cuda "$@"
}

command_1() {
    acceptance 1 160 ddp,resume,fsdp,syncs # designed for 130 s, its --time-limit 135
    pytest_part "deferred construction (test_large_model.py)" 55 tests/gpu/test_large_model.py
    pytest_part "tensor parallel (test_tensor_parallel.py)" 115 tests/gpu/test_tensor_parallel.py
}

command_2() {
    pytest_part "CUDA tests (the rest of tests/gpu)" 110 tests/gpu --ignore=tests/gpu/test_tensor_parallel.py \
        --ignore=tests/gpu/test_large_model.py
    acceptance 2 220 precision,speed,plan,prefetch,processes,compile,tune
}

for n in 1 2; do
    if [ "$which" != all ] && [ "$which" != "$n" ]; then continue; fi
    results=$out/command-$n.txt
    { echo "# gpu_check.sh $n, $(date '+%Y-%m-%d %H:%M:%S'), torch ${seen% *}"; nvidia-smi -L 2>&1; } | tee -a "$results"
    "command_$n"
done
echo
printf '%-44s %-10s %s\n' "gpu_check.sh $which: part" verdict "seconds, figure" | tee -a "$results"
printf '%s\n' "${rows[@]}" | tee -a "$results"
exit "$worst"
