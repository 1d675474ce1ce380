#!/usr/bin/env bash
# `make test` and `make test-fast`: the tests not marked serial on TEST_WORKERS processes at once
# (pytest-xdist; tests wait on process starts, collectives and timeouts as much as they compute),
# then the tests marked serial alone, since they assert on wall-clock time or share the GPUs.
# Both parts run; the exit status is the first failure's. Arguments go to both pytest runs.
set -u
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-2}
status=0
part() {
    "$PY" -m pytest -q "$@"
    local code=$?
    [ "$code" -eq 5 ] && code=0  # nothing of this part selected by the arguments
    [ "$status" -eq 0 ] && status=$code
}
started=$SECONDS
part -n "$WORKERS" -m "not serial" "$@"
part -m serial "$@"
echo "tests: both parts took $((SECONDS - started)) s"
exit "$status"
