#!/usr/bin/env bash
# The peers in the same run, on the GPU machine (it has no package index), then one JSON:
#   1. build: llama.cpp with CUDA for this card's architecture, from the sources vendored in
#      llama-cpp-python's sdist, packed beforehand on a machine with PyPI by
#        bash /work/shared/tools/llamacpp-src.sh artifacts/lcpp        (artifacts/ is ignored;
#      carry artifacts/lcpp); built in $LCPP (default /tmp/lcpp), which stays while the machine
#      is warm: a later call with the same .tgz reuses the build (about 4 min on an H100, 16 jobs);
#   2. bench: llama-bench (pp512 and tg128, flash attention on, every layer on the GPU, $REPS
#      repetitions) and llama-batched-bench ($NPP prompt + $NTG generated tokens for each of
#      $BATCHES sequences at once) on the project's own GGUF (the Q4_1 file pagedkv reads);
#   3. model: python -m pagedkv.bench.model at the same batches ($MODEL_FLAGS added);
#   4. report: perf/peers_report.py -> $OUT/peers-<card>-<date>.json (the card, the date, the
#      commands, each tool's numbers and the decode step side by side).
# Usage: bash perf/peers_run.sh [TGZ]        (default artifacts/lcpp/llama.cpp.tgz)
# Env: OUT (artifacts/peers), PHASES (default "build bench model report"; e.g. two calls of
# "build bench" and "model report" keep each under the 10-minute limit), JOBS (16), BATCHES
# ("1 8 64 256"), NPP, NTG (128), REPS (5), KVU (1: llama-batched-bench with one unified K/V
# buffer, -kvu), MODEL_FLAGS, DRY=1 (print every command, run none; what the CPU test checks:
# needs only GGUF=path and CARD="name, driver, memory, compute capability").
set -uo pipefail
cd "$(dirname "$0")/.."
tgz=${1:-artifacts/lcpp/llama.cpp.tgz}
out=${OUT:-artifacts/peers}; lcpp=${LCPP:-/tmp/lcpp}; jobs=${JOBS:-16}
batches=${BATCHES:-1 8 64 256}; npp=${NPP:-128}; ntg=${NTG:-128}; reps=${REPS:-5}
phases=${PHASES:-build bench model report}
mkdir -p "$out"
status=0
say() { echo "+ $*" >&2; }
run() { say "$@"; [ -n "${DRY:-}" ] || "$@"; }        # run CMD...: echoed, then run
want() { [[ " $phases " == *" $1 "* ]]; }

if [ -n "${DRY:-}" ]; then
  gguf=${GGUF:?DRY needs GGUF=path}; card=${CARD:?DRY needs CARD=...}
else
  source perf/device_env.sh || exit 1                  # the model file, PYTHONPATH
  gguf=$PAGEDKV_GGUF
  card=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
         --format=csv,noheader | head -1)
fi
echo "$card" > "$out/card.txt"
arch=$(echo "$card" | awk -F', *' '{print $4}' | tr -d '.')    # compute capability 9.0 -> 90
src=$lcpp/llama.cpp; bin=$src/build/bin
cmake_line=(cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON
  "-DCMAKE_CUDA_ARCHITECTURES=$arch" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=OFF)
build_line=(cmake --build "$src/build" -j "$jobs" --target llama-bench llama-batched-bench)

if want build; then
  stamp=$([ -e "$tgz" ] && sha256sum "$tgz" | cut -d' ' -f1)
  if [ -z "${DRY:-}" ] && [ -x "$bin/llama-batched-bench" ] && \
     [ "$(cat "$lcpp/stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "build: reusing $bin (the same $tgz)"
  else
    run rm -rf "$lcpp"; run mkdir -p "$lcpp"; run tar xzf "$tgz" -C "$lcpp"
    t0=$(date +%s)
    run "${cmake_line[@]}" > "$out/build.log" 2>&1 || status=1
    run "${build_line[@]}" >> "$out/build.log" 2>&1 || status=1
    t1=$(date +%s)
    [ -n "${DRY:-}" ] || tail -3 "$out/build.log"
    { echo "source=$(basename "$tgz") (llama-cpp-python's sdist, vendored llama.cpp)"
      echo "sha256=$stamp"
      echo "llama_cpp_version=$(grep -o 'LLAMA_VERSION_M[A-Z]* [0-9]*' "$src/CMakeLists.txt" \
                                 2>/dev/null | awk '{print $2}' | paste -sd.)"
      echo "cmake=${cmake_line[*]}"; echo "build=${build_line[*]}"
      echo "cuda_architectures=$arch"; echo "build_s=$((t1 - t0))"; } > "$out/build.txt"
    [ -n "${DRY:-}" ] || [ $status -ne 0 ] || echo "$stamp" > "$lcpp/stamp"
  fi
fi

if want bench; then
  max=$(echo $batches | tr ' ' '\n' | sort -n | tail -1)
  list=$(echo $batches | tr ' ' ',')
  kvu=(); [ "${KVU:-0}" = 1 ] && kvu=(-kvu)
  bench_line=("$bin/llama-bench" -m "$gguf" -ngl 99 -fa on -p 512 -n 128 -r "$reps" -o json)
  batched_line=("$bin/llama-batched-bench" -m "$gguf" -ngl 99 -fa on
    -c $((max * (npp + ntg))) -b 2048 -ub 512 -npp "$npp" -ntg "$ntg" -npl "$list"
    "${kvu[@]}" --output-format jsonl)
  { echo "llama_bench=${bench_line[*]}"; echo "llama_batched_bench=${batched_line[*]}"; } \
    >> "$out/build.txt"
  run timeout 300 "${bench_line[@]}" > "$out/llama-bench.json" 2> "$out/llama-bench.log" \
    || status=1
  run timeout 300 "${batched_line[@]}" > "$out/llama-batched-bench.jsonl" \
    2> "$out/llama-batched-bench.log" || status=1
  [ -n "${DRY:-}" ] || tail -6 "$out/llama-batched-bench.jsonl"
fi

if want model; then
  echo "pagedkv_bench_model=python3 -m pagedkv.bench.model --batches $batches ${MODEL_FLAGS:-}" \
    >> "$out/build.txt"
  # shellcheck disable=SC2086
  run timeout 540 python3 -m pagedkv.bench.model --batches $batches --json "$out/model.json" \
    ${MODEL_FLAGS:-} > "$out/model.log" 2>&1 || status=1
  [ -n "${DRY:-}" ] || tail -12 "$out/model.log"
fi

if want report; then
  name=$(echo "$card" | awk -F', *' '{print $1}' | tr 'A-Z ' 'a-z-' | sed 's/^nvidia-//')
  run python3 perf/peers_report.py "$out" --json "$out/peers-$name-$(date +%F).json" \
    || status=1
fi
exit $status
