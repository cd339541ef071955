#!/usr/bin/env bash
# The wheels tools/gpu_check.sh needs on the GPU machine (Python 3.12, no network), fetched here
# into .whl/ (git-ignored; carried with the run, well under 64 MiB): megatron-core 0.16.1 for
# cp312, and datasets with the two dependencies that image lacks. Nothing else is carried.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
for pkg in megatron-core==0.16.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d .whl "$pkg"
done
du -sh .whl
