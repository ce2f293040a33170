#!/usr/bin/env bash
# The offline benchmark of a baseline commit and of this tree, one after the other in one call:
#   benchmarks/offline_baseline.sh prepare REF     here: REF's files into .base/ (git-ignored
#                                                  locally through info/exclude; carry it)
#   benchmarks/offline_baseline.sh run OUT ARGS... there: .base/ installed into /tmp/weft-base,
#                                                  then `offline.py ARGS` of the baseline, then of
#                                                  this tree; JSON + markdown in OUT/{base,this}.*
#   benchmarks/offline_baseline.sh base|this OUT ARGS...   one side only (two calls, one machine)
# The baseline runs from its own files (PYTHONPATH=/tmp/weft-base ahead of this tree's install);
# paths in ARGS must be absolute (it runs from /tmp).
set -euo pipefail
py="${PYTHON:-python3}"  # the interpreter with weft installed
cd "$(dirname "$0")/.."

case "${1:-}" in
prepare)
    ref="${2:?usage: $0 prepare REF}"
    rm -rf .base && mkdir .base
    git archive "$ref" | tar -x -C .base
    git rev-parse "$ref" > .base/.ref
    exclude="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.base/' "$exclude" 2>/dev/null || echo '/.base/' >> "$exclude"
    echo "baseline $(cat .base/.ref) in .base/ ($(du -sh .base | cut -f1)); carry \".base\""
    ;;
run | base | this)
    side="$1"
    out="${2:?usage: $0 run|base|this OUT ARGS...}"
    shift 2
    mkdir -p "$out"
    out="$(cd "$out" && pwd)"
    if [ "$side" != this ]; then
        [ -f .base/.ref ] || { echo "no .base/: run '$0 prepare REF' first, carry .base" >&2; exit 2; }
        rm -rf /tmp/weft-base
        "$py" -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/weft-base ./.base
        echo "=== baseline $(cat .base/.ref)"
        # NOTE: from a folder without a weft/ (its children run `python -m`: the folder comes first)
        root="$(pwd)"
        (cd /tmp && PYTHONPATH=/tmp/weft-base "$py" "$root/.base/benchmarks/offline.py" "$@" \
            --output-file "$out/base.json" > "$out/base.log" 2>&1) || echo "baseline failed: $out/base.log"
        tail -n 30 "$out/base.log"
    fi
    if [ "$side" != base ]; then
        echo "=== this tree $(git rev-parse HEAD 2>/dev/null || echo '(no git here)')"
        "$py" benchmarks/offline.py "$@" --output-file "$out/this.json" > "$out/this.log" 2>&1 \
            || echo "this tree failed: $out/this.log"
        tail -n 30 "$out/this.log"
    fi
    ;;
*)
    echo "usage: $0 prepare REF | run|base|this OUT ARGS..." >&2
    exit 2
    ;;
esac
