# Sourced by the other scripts: run everything with the project's .venv, and make its
# "python3" kernel (registered by scripts/setup.sh) the one Jupyter finds first.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="$ROOT/.venv/bin:$PATH"
export JUPYTER_PATH="$ROOT/.venv/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
export JUPYTER_PLATFORM_DIRS=1
export PYDEVD_DISABLE_FILE_VALIDATION=1
