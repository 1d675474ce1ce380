#!/usr/bin/env bash
# On a machine with a CUDA GPU: every part runs whatever the one before did, each is reported
# (passed/failed, exit code, seconds), and the exit code is non-zero when any failed.
#   1. the CUDA tests (tests/gpu but part 2's file; they skip without a GPU), at most 300 s
#   2. tensor parallelism on one GPU (tests/gpu/test_tensor_parallel.py: tp alone, tp 2 and tp 2 x dp 2
#      on processes sharing cuda:0 over gloo, fsdp x tp 1 x 2), at most 240 s
#   3. the GPU acceptance tier, tests/gpu/acceptance (python -m tests.gpu.acceptance.run: every CUDA
#      path one GPU can run; about 7 minutes on an H200, at most 540 s), its arguments passed on,
#      e.g. --out runs/gpu-check.json
# PARTS picks parts by number (default 1,2,3): the three limits add up to 18 minutes, over one
# device command's 10, so a lent GPU runs `PARTS=1,2 bash benchmarks/gpu_check.sh` (9 minutes at
# most), then `PARTS=3 ...` if time is left.
# Set-up as usual: `make setup` first. PY picks the interpreter (default .venv/bin/python).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONUNBUFFERED=1  # the parts' progress shows as it happens, through tee

names=()
codes=()
times=()
lasts=()
log=$(mktemp)
trap 'rm -f "$log"' EXIT

PARTS=${PARTS:-1,2,3}
number=0

part() {  # part NAME COMMAND...: run it, remember its exit code, time and last line of output
    local name=$1 started rc
    shift
    number=$((number + 1))
    case ",$PARTS," in *",$number,"*) ;; *) echo "== gpu_check.sh: $name: not in PARTS=$PARTS"; return ;; esac
    echo "== gpu_check.sh: $name: $*"
    started=$(date +%s)
    "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    names+=("$name")
    codes+=("$rc")
    times+=("$(($(date +%s) - started))")
    lasts+=("$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c1-150)")
    echo "== gpu_check.sh: $name: exit $rc"
}

nvidia-smi -L || echo "gpu_check.sh: nvidia-smi not found or no GPU listed"
tp_tests=tests/gpu/test_tensor_parallel.py
part "CUDA tests (tests/gpu)" timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/gpu --ignore="$tp_tests"
part "tensor parallel" timeout 240 "$PY" -m pytest -q -s -p no:cacheprovider -m cuda "$tp_tests"
part "tests/gpu/acceptance" timeout 540 "$PY" -m tests.gpu.acceptance.run "$@"

echo
echo "gpu_check.sh summary:"
failed=0
for i in "${!names[@]}"; do
    rc=${codes[$i]}
    if [ "$rc" -eq 0 ]; then verdict=passed; else verdict=failed; failed=1; fi
    if [ "$rc" -eq 124 ]; then verdict="failed (timed out)"; fi
    printf '  %-24s %-20s exit %3d  %5ss  %s\n' "${names[$i]}" "$verdict" "$rc" "${times[$i]}" "${lasts[$i]}"
done
exit $failed
