# Sourced by perf/http_run.sh, perf/serve_run.sh and perf/engine_run.sh on the GPU machine
# (no package index): the model file joined from its parts (each earlier call copies the part
# it carried, .bigfile/partNN, to /tmp/model.partNN, and the machine keeps /tmp while it stays
# warm; this call brings the last part and .bigfile/sha256) and checked, the wheels in WHEELS
# (default .whls: gguf, starlette, uvicorn, openai and what they need) installed into
# /tmp/site once, and PYTHONPATH and PAGEDKV_GGUF exported. Returns 1 if the model or the
# wheels are missing.
model=/tmp/model.gguf
if [ ! -e "$model" ]; then
  for p in .bigfile/part*; do cp "$p" "/tmp/model.$(basename "$p")"; done
  cat /tmp/model.part* > "$model"
fi
echo "$(cat .bigfile/sha256)  $model" | sha256sum -c - || return 1
if [ ! -e /tmp/site/gguf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "${WHEELS:-.whls}"/*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD PAGEDKV_GGUF=$model PYTHONUNBUFFERED=1
