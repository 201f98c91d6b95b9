#!/usr/bin/env bash
# perf_analyzer (from tritonclient[all]==2.50) against a running triton-diffusion server.
# The models are decoupled, so it runs over gRPC streaming; client/perf_input.json holds prompts only
# (one uniform input set, so Triton can batch the requests). Writes a CSV.
#
#   scripts/perf_analyzer.sh                                  # text_to_image on localhost:8001
#   MODEL=text_to_image_flux CONCURRENCY=1:16:1 WINDOW_REQUESTS=50 STABILITY=25 OUT=pa.csv scripts/perf_analyzer.sh
#   INTERVAL_MS=5000 scripts/perf_analyzer.sh                 # fixed time windows instead
#   scripts/perf_analyzer.sh --request-parameter num_inference_steps:8:int   # extra args go to perf_analyzer
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
MODEL="${MODEL:-text_to_image}"
URL="${URL:-localhost:8001}"
CONCURRENCY="${CONCURRENCY:-1:8:1}"
# A window ends once WINDOW_REQUESTS requests have completed (perf_analyzer's count windows), however slow
# the machine: a fixed time window on a loaded CPU can close with no request completed, and perf_analyzer
# then stops the sweep ("No valid requests recorded"). INTERVAL_MS asks for fixed time windows instead.
WINDOW_REQUESTS="${WINDOW_REQUESTS:-20}"
if [ -n "${INTERVAL_MS:-}" ]; then
  WINDOWS=(--measurement-mode time_windows --measurement-interval "$INTERVAL_MS")
else
  WINDOWS=(--measurement-mode count_windows --measurement-request-count "$WINDOW_REQUESTS")
fi
STABILITY="${STABILITY:-25}"  # percent; perf_analyzer's 10 rarely settles on a small shared CPU machine
OUT="${OUT:-$REPO_ROOT/bench_results/perf_analyzer.csv}"
PERF_ANALYZER="${PERF_ANALYZER:-$VENV/bin/perf_analyzer}"
mkdir -p "$(dirname "$OUT")"
OUT="$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")"  # absolute: the run below changes directory

# The binary wants libb64.so.0d and libcudart.so.12 (even on CPU). Both ship, under other names, in the
# nvidia-pytriton wheel the project already installs: link them into a private folder.
LIBS="$VENV/perf-analyzer-libs"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$LIBS"
for pair in "libb64.so.0d:libb64-*.so.0d" "libcudart.so.12:libcudart-*.so.12*"; do
  name="${pair%%:*}"
  pattern="${pair#*:}"
  if [ ! -e "$LIBS/$name" ]; then
    source_lib="$(ls "$SITE"/nvidia_pytriton.libs/$pattern 2>/dev/null | head -n 1 || true)"
    [ -n "$source_lib" ] || { echo "perf_analyzer.sh: $pattern not found in nvidia_pytriton.libs" >&2; exit 1; }
    ln -sf "$source_lib" "$LIBS/$name"
  fi
done
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

cd "$(dirname "$OUT")"  # perf_analyzer writes a few side files into the working directory
rm -f "$OUT"
"$PERF_ANALYZER" -m "$MODEL" -u "$URL" -i grpc --streaming --async \
  --input-data "$REPO_ROOT/client/perf_input.json" --concurrency-range "$CONCURRENCY" \
  "${WINDOWS[@]}" --stability-percentage "$STABILITY" -f "$OUT" "$@"

# perf_analyzer ends a sweep at the first level it cannot measure stably and still exits 0, leaving a
# CSV that silently lacks the higher levels: fail. (Not where extra arguments end or shape the sweep on
# purpose: a latency limit, a binary search, request rates.)
for arg in "$@"; do
  case "$arg" in
    -l|--latency-threshold*|--binary-search|--request-rate-range*|--request-intervals*) exit 0 ;;
  esac
done
IFS=: read -r first last step <<<"$CONCURRENCY"
last="${last:-$first}"
step="${step:-1}"
expected=$(( last >= first ? (last - first) / step + 1 : 1 ))
written=0
[ -s "$OUT" ] && written=$(( $(wc -l <"$OUT") - 1 ))
if [ "$written" -lt "$expected" ]; then
  echo "perf_analyzer.sh: $written of $expected concurrency levels measured ($OUT); perf_analyzer" \
    "stopped the sweep (its message is above): if not stable, raise WINDOW_REQUESTS or STABILITY" >&2
  exit 2
fi
