#!/usr/bin/env bash
# The peer the bench compares against side by side: faster-whisper-server 0.0.3 from PyPI (an
# OpenAI-compatible FastAPI server around faster-whisper), in its own venv, .venv-peer in the
# repo root (git-ignored). Idempotent: does nothing when that venv already has it.
#
#     bash loadtest/peer_setup.sh            # then: python -m loadtest.peer --help
#
# Pins: faster-whisper 1.2.1 and ctranslate2 4.8.5, the versions the service's own venv runs, so
# the comparison is of the servers, not of two engine builds (0.0.3 asks for faster-whisper>=1.2.1
# and would otherwise take whatever is newest). Python 3.11 like .venv (0.0.3 wants >= 3.10).
# Nothing else is fetched: the model is the service's local CTranslate2 folder, passed as a path
# (see loadtest/peer.py), and the server runs with HF_HUB_OFFLINE=1.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV="$ROOT/.venv-peer"
PEER="faster-whisper-server==0.0.3"
PINS=(faster-whisper==1.2.1 ctranslate2==4.8.5)

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null
from importlib.metadata import version
assert version("faster-whisper-server") == "0.0.3"
assert version("faster-whisper") == "1.2.1" and version("ctranslate2") == "4.8.5"
import faster_whisper_server.cli  # noqa: F401  (imports: the venv is whole)
PY
then
  echo "peer venv ready: $VENV"
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

rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$PEER" "${PINS[@]}"
"$VENV/bin/python" -c 'import faster_whisper_server.cli, ctranslate2, faster_whisper; print("peer venv ready:", faster_whisper.__version__, ctranslate2.__version__)'
