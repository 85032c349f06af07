#!/usr/bin/env bash
# Print the path of a working python$1 (e.g. 3.12), or fail saying what was tried.
# `python3.12` on PATH may be a pyenv shim that refuses to run when 3.12 is not pyenv's
# selected version, so pyenv's own installs are tried after it.
set -euo pipefail
version="${1:?usage: find_python.sh 3.12}"
shopt -s nullglob
candidates=()
if on_path="$(command -v "python$version")"; then
    candidates+=("$on_path")
fi
for dir in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin; do
    candidates+=("$dir/python$version")
done
for py in "${candidates[@]}"; do
    if [[ -x "$py" ]] && "$py" -c 'import sys' >/dev/null 2>&1; then
        "$py" -c 'import sys; print(sys.executable)'
        exit 0
    fi
done
echo "find_python.sh: no working python$version (tried: ${candidates[*]:-nothing})" >&2
exit 1
