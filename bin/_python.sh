# Shared by bin/*: find Python >= 3.12, keep .venv installed from pyproject.toml,
# and keep the previous run's logs.
find_python() {
  for candidate in "${PYTHON:-}" python3.12 python3.13 python3 \
      /root/.pyenv/versions/3.12*/bin/python3 /root/.pyenv/versions/3.13*/bin/python3; do
    [ -n "$candidate" ] || continue
    for exe in $(command -v "$candidate" 2>/dev/null || ls $candidate 2>/dev/null); do
      if "$exe" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
        echo "$exe"; return 0
      fi
    done
  done
  echo "Python >= 3.12 is required (Django 6); set PYTHON=/path/to/python3.12" >&2
  return 1
}

ensure_venv() {
  local extras="${1:-}"
  local stamp=".venv/.installed-${extras:-main}"
  if [ ! -x .venv/bin/python ]; then
    local py
    py="$(find_python)"
    "$py" -m venv .venv
  fi
  # The test extras include every main dependency: a .venv installed for
  # the tests serves the quick start as it is.
  if [ -z "$extras" ] && [ -f .venv/.installed-test ] && [ ! pyproject.toml -nt .venv/.installed-test ]; then
    return 0
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    local target="."
    [ -n "$extras" ] && target=".[$extras]"
    mkdir -p var/log
    # One log per extras set, so the test install does not overwrite the
    # quick start's.
    local log="var/log/pip-install-${extras:-main}.log"
    echo "installing the project${extras:+ with its $extras extras} into .venv (the first install takes a few minutes; log: $log)" >&2
    if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e "$target"; } \
        >"$log" 2>&1; then
      tail -n 40 "$log" >&2
      echo "installing the project into .venv failed; full log: $log" >&2
      return 1
    fi
    touch "$stamp"
  fi
}

rotate_logs() {  # rotate_logs <dir> <name>…: move each <dir>/<name>.log to <name>.log.1 (one generation)
  # A second run of bin/quickstart would otherwise truncate the logs of the
  # run before it, which are the ones to read after a failure.
  local dir="$1"; shift
  local name
  for name in "$@"; do
    if [ -f "$dir/$name.log" ]; then
      mv -f "$dir/$name.log" "$dir/$name.log.1"
    fi
  done
}
