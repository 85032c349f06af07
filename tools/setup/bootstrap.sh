#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine (Python 3.11), also fine on a ready one.
#
#   1. Debian packages, only the missing ones (one `apt-get update`, only if needed):
#      PostgreSQL server binaries (initdb under /usr/lib/postgresql/*/bin),
#      a Java 17 runtime (if `java` is not on PATH), python3.11 + venv, make, and what
#      building the C extensions (dstl._records_c, dstl._durable_c, backends._heapstate_c)
#      needs (gcc, the interpreter's headers). The package installs without them (the
#      pure-Python fallbacks run then), but here we want the fast path, and check it.
#   2. .venv with python3.11, if absent (or broken).
#   3. pip install -c tools/setup/constraints.txt -e ".[test]" (which also compiles the C
#      extensions in place), only when pyproject.toml, constraints.txt or a C source changed
#      since the last successful install (hash in .venv/.bootstrap-stamp).
#
# A second run does nothing and takes well under a second.
# Environment: PYTHON=/path/to/python3.11 to choose the interpreter for a new venv;
#              BOOTSTRAP_VENV=DIR for a venv other than .venv (make test-pythons makes
#              .venv-3.12 and .venv-3.13 with PYTHON=python3.12 / python3.13);
#              BOOTSTRAP_FORCE=1 to reinstall even if the stamp matches.
#
# Usage: bootstrap.sh [test|demo]. `test` (the default: make test, make setup) installs
# everything the suite needs; `demo` (make demo) skips what only tests use: no PostgreSQL
# server, no test extras, and the C extensions are optional (without a compiler the
# pure-Python twins run, slower, with a warning).
set -euo pipefail

FOR="${1:-test}"
case "$FOR" in test | demo) ;; *) printf 'bootstrap: usage: bootstrap.sh [test|demo]\n' >&2; exit 2 ;; esac

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT="$PWD"
VENV="${BOOTSTRAP_VENV:-$ROOT/.venv}"
STAMP="$VENV/.bootstrap-stamp"
CONSTRAINTS="tools/setup/constraints.txt"

log() { printf 'bootstrap: %s\n' "$*" >&2; }
die() { printf 'bootstrap: ERROR: %s\n' "$*" >&2; exit 1; }

# --- 1. Debian packages -------------------------------------------------------------------
missing=()
optional=()   # wanted, but the command runs without them (the C extensions' build tools)
why=()        # one phrase per package: what it is for, for the error message

if [[ "$FOR" == test ]] && ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
    missing+=(postgresql)               # Debian 12: PostgreSQL 15 (server, initdb, pg_ctl)
    why+=("postgresql: the metadata store tests start a real server")
fi
if ! command -v java >/dev/null 2>&1; then
    missing+=(openjdk-17-jre-headless)
    why+=("openjdk-17-jre-headless: Spark runs on Java 17")
fi
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
    PYTHON="$(command -v python3.11 || true)"
fi
if [[ -z "$PYTHON" ]]; then
    missing+=(python3.11 python3.11-venv)
    PYTHON=/usr/bin/python3.11
elif [[ ! -x "$VENV/bin/python" ]] && ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=(python3.11-venv)          # Debian splits ensurepip out of python3.11
fi
if ! command -v make >/dev/null 2>&1; then
    missing+=(make)
fi
if ! command -v gcc >/dev/null 2>&1; then
    if [[ "$FOR" == test ]]; then missing+=(gcc); else optional+=(gcc); fi
    why+=("gcc: compiles the C extensions (the hot path)")
fi
# Python.h of the interpreter the venv uses (pyenv and python.org builds ship it; Debian's
# python3.11 needs python3.11-dev).
if [[ -x "$PYTHON" ]] && ! "$PYTHON" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    >/dev/null 2>&1; then
    if [[ "$FOR" == test ]]; then missing+=(python3.11-dev); else optional+=(python3.11-dev); fi
    why+=("python3.11-dev: the interpreter's headers, for the C extensions")
fi

wanted=("${missing[@]}" "${optional[@]}")
if ((${#wanted[@]})); then
    SUDO=()
    can=yes
    if [[ "$(id -u)" -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1; then SUDO=(sudo); else can=""; fi
    fi
    command -v apt-get >/dev/null 2>&1 || can=""
    if [[ -n "$can" ]]; then
        log "installing Debian packages: ${wanted[*]}"
        "${SUDO[@]}" apt-get update -qq || die "apt-get update failed"
        "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${wanted[@]}" \
            || die "apt-get install ${wanted[*]} failed"
    elif ((${#missing[@]})); then
        die "missing system packages, and no root, sudo or apt-get to install them: $(printf '%s; ' "${why[@]}")install them by hand (Debian: apt-get install ${missing[*]})"
    else
        log "WARNING: no compiler or Python headers (${optional[*]}) and no way to install them: the pure-Python twins of the C extensions run instead (slower)"
    fi
fi

if [[ "$FOR" == test ]]; then
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null \
        || die "PostgreSQL server binaries still missing (/usr/lib/postgresql/*/bin/initdb)"
fi
command -v java >/dev/null 2>&1 || die "java still not on PATH (Spark needs Java 17)"

# --- 2. virtualenv ------------------------------------------------------------------------
if ! "$VENV/bin/python" -c '' >/dev/null 2>&1; then
    [[ -x "$PYTHON" ]] || die "no python3.11 interpreter ($PYTHON)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))' \
        || die "$PYTHON is older than 3.11"
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv --clear "$VENV" || die "python -m venv failed"
fi

# --- 3. project + pinned dependencies -----------------------------------------------------
# Extensions built before they were renamed *_c (issue 17) would shadow the Python modules
# dstl/_records.py, dstl/_durable.py and backends/_heapstate.py, which pick C or Python:
# an extension module wins over a .py of the same name.
rm -f dstl/_records.cpython-*.so dstl/_durable.cpython-*.so backends/_heapstate.cpython-*.so
want="$(cat pyproject.toml "$CONSTRAINTS" dstl/*.[ch] backends/*.c | sha256sum | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"
# compiled in place, one file per interpreter version; gone after a git clean
suffix="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
built=""
if [[ -f "dstl/_records_c$suffix" && -f "dstl/_durable_c$suffix" \
    && -f "backends/_heapstate_c$suffix" ]]; then
    built=yes
fi
# The stamp records what was installed: a test install serves the demo too, not the reverse.
[[ "$have" == "$want test" || ( "$FOR" == demo && "$have" == "$want demo" ) ]] && current=yes || current=""
compilers=yes
command -v gcc >/dev/null 2>&1 || compilers=""
[[ -z "$built" && -z "$compilers" && "$FOR" == demo && -n "$current" ]] && built=twins
if [[ -z "$current" || -z "$built" || -n "${BOOTSTRAP_FORCE:-}" ]]; then
    spec="."
    modules="pyarrow, fsspec, s3fs, sqlalchemy, rocksdict, pyspark"
    if [[ "$FOR" == test ]]; then
        spec=".[test]"
        modules="$modules, moto, psycopg"
    fi
    [[ -n "$compilers" ]] && modules="$modules, dstl._records_c, dstl._durable_c, backends._heapstate_c"
    log "installing the project ($spec) and its pinned dependencies into $VENV"
    rm -f "$STAMP"
    "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q \
        -c "$CONSTRAINTS" -e "$spec" \
        || die "pip install -c $CONSTRAINTS -e $spec failed"
    "$VENV/bin/python" -c "import $modules" \
        || die "installed, but a dependency (or a C extension) does not import"
    printf '%s %s\n' "$want" "$FOR" >"$STAMP.tmp" && mv -f "$STAMP.tmp" "$STAMP"
    log "done"
fi
