#!/usr/bin/env bash
# The system tools the tests use beyond Python packages: bubblewrap (the default HumanEval
# sandbox) and g++ with binutils (selfspec's kernels, the AMX build check). Installs the missing
# ones with apt-get where this runs as root on Debian/Ubuntu; elsewhere it says which are missing
# (the tests that need them skip, naming the tool) and carries on.
set -u
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v g++ >/dev/null || missing+=(g++)
command -v objdump >/dev/null || missing+=(binutils)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    if apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 \
             && apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; }; then
        echo "installed: ${missing[*]}"
        exit 0
    fi
    echo "apt-get could not install ${missing[*]}; the tests that need them skip" >&2
else
    echo "not installed (needs root and apt-get): ${missing[*]}; the tests that need them" \
         "skip; install them to run those tests" >&2
fi
exit 0
