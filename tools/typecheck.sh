#!/usr/bin/env bash
# mypy over the dora_rl namespace: the role folders are mapped into dora_rl.* only at install time, so
# assemble the package tree under build/typecheck (a copy) and map reported paths back to the sources.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf build/typecheck && mkdir -p build/typecheck/dora_rl
cp dora_rl/*.py build/typecheck/dora_rl/
for d in producers consumers schemas streams infra; do
  cp -r "$d" "build/typecheck/dora_rl/$d"
done
find build/typecheck -name __pycache__ -prune -exec rm -rf {} +
cd build/typecheck
../../.venv/bin/python -m mypy --config-file ../../pyproject.toml -p dora_rl 2>&1 \
  | sed -E 's#^dora_rl/(producers|consumers|schemas|streams|infra)/#\1/#'
