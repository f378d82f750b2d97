#!/usr/bin/env bash
# The developers' routine before a change is submitted (CONTRIBUTING.md): what CI checks beyond the tests, and,
# when the change touches how LambdaLayer picks its implementation, the `auto` guard of issue 39: `lambdanet bench
# impls` on this machine, failing when `auto` is slower than 1.2x the fastest implementation at any point.
#
#   scripts/prestop.sh [BASE]      BASE: the revision the change starts from (default: origin/main, else HEAD~1)
#
# Run it on a quiet machine: the benchmark times implementations against each other (about an hour on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BASE=${1:-$(git rev-parse --verify -q origin/main || git rev-parse HEAD~1)}

"${PY%/python}/ruff" check lambdanet tests hubconf.py .ci/core_smoke.py
"${PY%/python}/ruff" format --check lambdanet
"${PY%/python}/mypy"
"${PY%/python}/mkdocs" build --strict --quiet --site-dir "$(mktemp -d)"
duplicates --change --base "$BASE" || true

# the code that decides which implementation `auto` runs: the policy, the tuner, the implementations it times
DISPATCH=('lambdanet/layers/lambda_*' 'lambdanet/layers/impl_*' lambdanet/functional lambdanet/kernels
          lambdanet/ops/position_lambda pyproject.toml)
changed=$(git diff --name-only "$BASE" -- "${DISPATCH[@]}" 2>/dev/null || true)
if [ -z "$changed" ]; then
  echo "prestop: no dispatch code changed since $BASE: the auto guard is not needed"
  exit 0
fi
echo "prestop: dispatch code changed since $BASE ($(echo $changed | tr '\n' ' ')): running the auto guard"
out=${PRESTOP_OUT:-bench_results/prestop}
"$PY" -m lambdanet bench impls --out "$out"
"$PY" scripts/check_auto.py "$out/impls.json"
