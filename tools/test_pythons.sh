#!/usr/bin/env bash
# `make test-pythons`: `make setup` and `make test` on every Python the package promises, each in a fresh clone of HEAD
# with its own .venv, one after the other (2 cores: two suites at once would each take twice as long).
#   PYTHONS       versions to try (default: settings.ini min_python up to 3.13)
#   PYTHONS_DIR   where the clones go (default /tmp/oelm-pythons; each clone's log beside it)
#   TORCH_PIN, TORCH_INDEX   passed on to each `make setup`
# An interpreter is looked up under pyenv (the newest patch release of that version), then on PATH as pythonX.Y.
# Exit status 1 when a found Python failed; a version not found is listed as such and fails nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
unset MAKEFLAGS MFLAGS MAKELEVEL  # each clone's make on its own, not with this make's variables
min=$(sed -n 's/^min_python *= *//p' settings.ini)
all="3.10 3.11 3.12 3.13"
versions=${PYTHONS:-$(for v in $all; do [ "$(printf '%s\n' "$min" "$v" | sort -V | head -1)" = "$min" ] && echo "$v"; done)}
dir=${PYTHONS_DIR:-/tmp/oelm-pythons}
mkdir -p "$dir"
head=$(git rev-parse --short HEAD)
[ -z "$(git status --porcelain --untracked-files=no)" ] || echo "[test-pythons] note: uncommitted changes are not tested (clones of HEAD $head)"

find_python() {  # $1 = X.Y -> path of an interpreter, or nothing
    local v=$1 pyroot p
    pyroot=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
    p=$(ls -d "$pyroot"/versions/"$v".*/bin/python 2>/dev/null | sort -V | tail -1)
    [ -n "$p" ] && [ -x "$p" ] && { echo "$p"; return; }
    p=$(command -v "python$v" 2>/dev/null) && [ -n "$p" ] && echo "$p"
}

results=() failed=0
for v in $versions; do
    py=$(find_python "$v")
    if [ -z "$py" ]; then results+=("$v|not found (pyenv install $v, or python$v on PATH)|-|-"); continue; fi
    clone="$dir/py$v" log="$dir/py$v.log"
    rm -rf "$clone"; git clone -q "$root" "$clone" && git -C "$clone" checkout -q "$head"
    echo "[test-pythons] Python $v ($py): make setup && make test in $clone (log: $log)"
    t0=$(date +%s)
    make -C "$clone" setup PYTHON="$py" TORCH_PIN="${TORCH_PIN:-torch==2.13.0}" TORCH_INDEX="${TORCH_INDEX:-}" >"$log" 2>&1
    rc=$? t1=$(date +%s)
    if [ $rc -eq 0 ]; then make -C "$clone" test >>"$log" 2>&1; rc=$?; fi
    t2=$(date +%s)
    build=$("$clone/.venv/bin/python" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__)" 2>/dev/null || echo "-")
    if [ $rc -eq 0 ]; then status=passed; else status="FAILED (see $log)"; failed=1; fi
    echo "[test-pythons] Python $v: $status; setup $((t1 - t0)) s, test $((t2 - t1)) s"
    results+=("$v|$status|$build|setup $((t1 - t0)) s, test $((t2 - t1)) s")
done
echo
printf '%-8s %-40s %-36s %s\n' python result interpreter times
for r in "${results[@]}"; do IFS='|' read -r v s b t <<<"$r"; printf '%-8s %-40s %-36s %s\n' "$v" "$s" "$b" "$t"; done
exit $failed
