#!/usr/bin/env bash
# The OpenEnv environment-server environment, made from the project's own files: a virtual
# environment ($OPENENV_VENV, default .venv-openenv) with openenv-core at the version of
# constraints-openenv.txt and what its server and CLI import (every package pinned there).
#
# Why its own environment: an OpenEnv environment is a server (FastAPI, WebSocket sessions) that
# runs where its author's packages are; openenv-core 0.3.0 declares gradio 6 (its optional web
# UI), whose huggingface-hub and pillow bounds the trainer's pinned transformers stack rules out.
# The trainer never imports openenv: megatron_p3o/env/openenv_client.py speaks its protocol.
# openenv-core goes in with --no-deps (gradio left out: the server imports it only for the web
# UI); its other requirements are installed from the constraints.
#
# Usage:  bash tools/openenv_env.sh        # then: $PWD/.venv-openenv/bin/openenv init my_env
#         OPENENV_REFRESH=1 bash tools/openenv_env.sh   # re-resolve and rewrite the pins
# An up-to-date environment (same constraints) is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OPENENV_VENV:-.venv-openenv}
PIN=$(sed -n 's/^openenv-core==\(.*\)$/\1/p' constraints-openenv.txt)
# what openenv-core requires, less gradio (its server and its `openenv init` import these)
DEPS=(fastapi uvicorn pydantic websockets requests fastmcp typer rich pyyaml tomli tomli-w
  huggingface_hub openai)
STAMP="$VENV/p3o-stamp"
want=$(sha256sum constraints-openenv.txt | cut -d' ' -f1)
if [[ -z ${OPENENV_REFRESH:-} && -f $STAMP && $(cat "$STAMP") == "$want" && -x $VENV/bin/python ]]; then
  echo "openenv env: $VENV is up to date (openenv-core $PIN)"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
if [[ -n ${OPENENV_REFRESH:-} ]]; then
  "$VENV/bin/pip" install -q --no-deps "openenv-core==$PIN"
  "$VENV/bin/pip" install -q "${DEPS[@]}"
  { sed -n '/^#/p' constraints-openenv.txt; "$VENV/bin/pip" freeze | grep -v '^-e'; } > constraints-openenv.txt.new
  mv constraints-openenv.txt.new constraints-openenv.txt
  want=$(sha256sum constraints-openenv.txt | cut -d' ' -f1)
else
  "$VENV/bin/pip" install -q --no-deps "openenv-core==$PIN"
  "$VENV/bin/pip" install -q -c constraints-openenv.txt "${DEPS[@]}"
fi
"$VENV/bin/python" -c "import openenv.core.env_server.http_server" # the server imports
echo "$want" > "$STAMP"
echo "openenv env: $VENV ready in $(( $(date +%s) - start ))s, $(du -sh "$VENV" | cut -f1) (openenv-core $PIN)"
