#!/usr/bin/env bash
# The side-by-side detection study (docs/detection.md): the default quick recipe on the built-in glyph scenes
# for ResNet-26, its +SE twin, its lambda hybrid and its halo hybrid, then each backbone alone at 512, 768
# and 1024 px (lambdanet bench detection), then the table in LambdaNetworks Table 6's layout. A finished run
# (summary.json) is skipped and an interrupted one resumed, so the script can be re-run after a crash.
# Run nothing else meanwhile: the training times and the benchmark are wall-clock measurements.
#
#   bash scripts/detect_study.sh [OUT]     # default OUT: runs/study
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/study}
LAMBDANET=${LAMBDANET:-lambdanet}
PY=${PYTHON:-python}
mkdir -p "$OUT"
for backbone in resnet26 resnet26_se lambda_resnet26 resnet26_se_halo_b8; do
  run="$OUT/$backbone"
  if [[ -f "$run/summary.json" ]]; then continue; fi
  if [[ -f "$run/last.pt" || -f "$run/pretrain.pt" ]]; then
    $LAMBDANET detect --out "$run" --resume --no-progress 2>&1 | tee -a "$OUT/$backbone.log"
  else
    $LAMBDANET detect --backbone "$backbone" --out "$run" --no-progress 2>&1 | tee "$OUT/$backbone.log"
  fi
done
if [[ ! -f "$OUT/bench/detection.json" ]]; then
  $LAMBDANET bench detection --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
fi
$PY -m lambdanet.tasks.detection.study "$OUT" "$OUT/bench/detection.json" | tee "$OUT/table.md"
