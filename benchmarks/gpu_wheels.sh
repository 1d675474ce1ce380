#!/usr/bin/env bash
# Before a lent GPU machine's first call: the wheels its python3 lacks for phalanx, into .whl/
# (ignored by git, carried by the device tool's `carry: [".whl"]`). That machine reaches no
# package registry and has a CUDA torch, numpy, PyYAML, rich, safetensors, pytest and hypothesis,
# but no pydantic; its python3 is CPython 3.12 on x86-64. The versions are those this machine's
# .venv resolved, so the lent run validates configs as the suite here does.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
platforms=()
for n in 2_28 2_27 2_24 2_17 2014; do
    if [ "$n" = 2014 ]; then platforms+=(--platform manylinux2014_x86_64); else platforms+=(--platform "manylinux_${n}_x86_64"); fi
done
for name in pydantic pydantic_core annotated-types typing-inspection; do
    version=$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$name==$version"
done
ls .whl
