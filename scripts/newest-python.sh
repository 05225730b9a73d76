#!/usr/bin/env bash
# Prints the newest other Python installed (3.13, then 3.12) for `make test-newest`, or nothing.
# Looks on the PATH, then in pyenv's versions: pyenv's shims run only the versions it selects, so
# `python3.13` there fails even where 3.13 is installed.
set -u
root="${PYENV_ROOT:-$HOME/.pyenv}"
for v in 3.13 3.12; do
    candidates=("python$v")
    for p in $(ls -d "$root"/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V -r); do
        candidates+=("$p")
    done
    for p in "${candidates[@]}"; do
        if out=$("$p" -c 'import sys; print(sys.executable)' 2>/dev/null); then
            echo "$out"
            exit 0
        fi
    done
done
