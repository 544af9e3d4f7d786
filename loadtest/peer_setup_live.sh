#!/usr/bin/env bash
# The live peer (issue 34): WhisperLive 0.10.0 from PyPI in its own venv, outside the repo
# (default /work/peers/whisperlive-venv, or $WHISPERLIVE_VENV). Idempotent: does nothing when
# that venv already imports it.
#
#     bash loadtest/peer_setup_live.sh     # then: python -m loadtest.live_peer --help
#
# whisper-live's own requirements pull in every backend it has (OpenVINO, optimum, openai-whisper,
# TensorRT helpers, CUDA wheels: several GB). Its faster_whisper backend, which is what the bench
# runs (with the service's whisper-base CTranslate2 folder, passed as a path), imports only what
# is installed below, so the package goes in with --no-deps and those by hand:
#   faster-whisper 1.2.0 (whisper-live's pin; it brings ctranslate2, tokenizers, onnxruntime, av)
#   torch (server.py and vad.py import it; the CPU build from the local wheelhouse when there is
#   one, else PyPI's), websockets, fastapi, uvicorn, numpy < 2.5, scipy (utils.py), and
#   prometheus-client (its metrics module), requests (huggingface_hub's, which faster-whisper
#   imports), tokenizers 0.20.3 (whisper-live's own pin).
# PyAudio is only for its microphone client, which the bench does not use (loadtest/live_peer.py
# streams over the WebSocket itself). The server runs with HF_HUB_OFFLINE=1: nothing is fetched.
set -euo pipefail
VENV=${WHISPERLIVE_VENV:-/work/peers/whisperlive-venv}
PEER="whisper-live==0.10.0"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null
from importlib.metadata import version
assert version("whisper-live") == "0.10.0" and version("faster-whisper") == "1.2.0"
import whisper_live.server  # noqa: F401  (its imports: the venv is whole)
import whisper_live.backend.faster_whisper_backend  # noqa: F401
PY
then
  echo "whisper-live venv ready: $VENV"
  exit 0
fi

PY=${PEER_PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3.10 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))'; then
      PY=$c; break
    fi
  done
fi
[ -n "$PY" ] || { echo "no Python 3.10-3.12 found (set PEER_PYTHON)" >&2; exit 1; }

TORCH=torch
CPU_WHEEL=$(ls /opt/wheels/torch-*+cpu-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$CPU_WHEEL" ]; then  # a CPU build at hand: no CUDA wheels on a CPU-only host
  TORCH="torch==$(basename "$CPU_WHEEL" | cut -d- -f2)"
fi

rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet --no-deps "$PEER"
"$VENV/bin/python" -m pip install --quiet "faster-whisper==1.2.0" "$TORCH" websockets fastapi \
  uvicorn "numpy>=1.26.4,<2.5" scipy prometheus-client python-multipart requests \
  "tokenizers==0.20.3"
"$VENV/bin/python" -c 'import whisper_live.server, faster_whisper, ctranslate2, torch; print("whisper-live venv ready:", faster_whisper.__version__, ctranslate2.__version__, torch.__version__)'
