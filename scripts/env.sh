# Sourced by scripts/serve and scripts/test: run with tcmalloc, which is what makes CPU batching
# pay (batches of 32: 38x realtime with it, 16x with glibc malloc, on 2 cores).
TCMALLOC=$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -n 1 || true)
if [ -n "$TCMALLOC" ]; then
  export LD_PRELOAD="$TCMALLOC${LD_PRELOAD:+:$LD_PRELOAD}"
fi
# No model hub at run time: everything the service loads ships in wheels or the model cache.
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Let Python cache compiled bytecode. uv installs no .pyc files, and with PYTHONDONTWRITEBYTECODE
# set (as it is on the CI host) every process compiled every module it imported, each time: 885
# modules, ~2 s of CPU per service start (6.6 -> 4.0 CPU-s measured), and the same again in each
# test worker, prep process, Ray actor and CLI the suite starts.
unset PYTHONDONTWRITEBYTECODE
