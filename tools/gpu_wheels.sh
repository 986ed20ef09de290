#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, into .whl/ (git-ignored through .git/info/exclude): zeroshard's runtime
# dependencies that its image does not hold (pydantic, hjson; typing_extensions, which it may hold too old) and, for bench/gpu.py --deepspeed, DeepSpeed 0.19.8
# (an sdist, built here into a pure-Python wheel with DS_BUILD_OPS=0: its ops JIT-build there on first use).
# That machine runs Python 3.12 with torch, has no network, and receives the working tree plus carried paths.
#
#   bash tools/gpu_wheels.sh            # here, where pip reaches the registry
#   # there (device tool: carry [".whl"]), before anything imports zeroshard:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf "$dest" && mkdir -p "$dest"
py=${PYTHON:-.venv/bin/python}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 hjson==3.1.0 \
    typing_extensions==4.16.0  # pydantic 2.14 imports names of typing_extensions 4.16 (Sentinel, TypeForm)
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" deepspeed==0.19.8
ls -la "$dest"
du -sh "$dest"
