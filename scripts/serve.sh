#!/usr/bin/env bash
# Set everything up (first run only) and start tritonserver on model_repository/, with the OpenAI-compatible
# front and the supervisor's health port. Ports from the environment (defaults in brackets):
#   HTTP_PORT [8000]  GRPC_PORT [8001]  METRICS_PORT [8002]  HEALTH_PORT [8003]  OPENAI_PORT [9000, 0: off]
# e.g. HTTP_PORT=18000 OPENAI_PORT=0 scripts/serve.sh. Extra arguments go to the launcher and then to
# tritonserver (--openai-api-key-file FILE asks the front's clients for a key; --log-verbose=1, ...).
# One line says when every model is ready, with the URLs.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/scripts/setup_env.sh"
exec "$REPO_ROOT/.venv/bin/triton-diffusion-serve" --model-repository "$REPO_ROOT/model_repository" \
  --openai-port "${OPENAI_PORT:-9000}" --health-port "${HEALTH_PORT:-8003}" \
  --http-port "${HTTP_PORT:-8000}" --grpc-port "${GRPC_PORT:-8001}" --metrics-port "${METRICS_PORT:-8002}" \
  "$@"
