#!/usr/bin/env bash
# Set everything up (first run only) and start tritonserver on model_repository/ (ports 8000/8001/8002),
# with the OpenAI-compatible front on port 9000 (--openai-port 0 turns it off; --openai-api-key-file FILE
# asks clients for a key). Extra arguments go to tritonserver, e.g. scripts/serve.sh --log-verbose=1
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/scripts/setup_env.sh"
exec "$REPO_ROOT/.venv/bin/triton-diffusion-serve" --model-repository "$REPO_ROOT/model_repository" \
  --openai-port 9000 "$@"
