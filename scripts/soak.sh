#!/usr/bin/env bash
# Run the tests that start processes round after round under a CPU load of twice the cores, and report
# every failure with its stacks: a flake is a bug to find, not a test to retry.
#   bash scripts/soak.sh ROUNDS [PYTEST ARGS...]
# e.g. bash scripts/soak.sh 2 TESTS
# PYTEST ARGS (TESTS above: test files, -k expressions...) default to every test file that starts
# processes (jobs, ranks, launchers, SLURM); slow tests skip unless FIXRES_RUN_SLOW=1. Each round runs
# pytest with its own --basetemp under $SOAK_DIR (default: a new folder in /tmp); a failing round's
# report names each failed test and copies the stacks the suite took of a hung test (<basetemp>/hung/,
# tests/conftest.py) and those every stalled job wrote (<job folder>/stalls/, the stall watchdog) next
# to its log. SOAK_LOAD: the number of busy processes (default: 2 x the cores; 0: none).
# Exit status: 0 if every round passed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-}
case "$ROUNDS" in
    ''|*[!0-9]*|0) echo "soak.sh: usage: bash scripts/soak.sh ROUNDS [PYTEST ARGS...] (ROUNDS >= 1)" >&2; exit 2 ;;
esac
shift
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || { echo "soak.sh: $PYTHON not found: run bash scripts/setup.sh first" >&2; exit 2; }
if [ $# -eq 0 ]; then
    mapfile -t files < <(grep -rlE --include='test_*.py' \
                         'run_script|start_script|start_group|run_interpreter|subprocess\.(run|Popen)' tests | sort)
    set -- "${files[@]}"
fi
SOAK_DIR=${SOAK_DIR:-$(mktemp -d -t soak.XXXXXX)}
mkdir -p "$SOAK_DIR"
LOAD=${SOAK_LOAD:-$((2 * $(nproc)))}
busy=()
cleanup() { [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 1 "$LOAD"); do
    "$PYTHON" -c 'while True: pass' & busy+=($!)
done
echo "soak: $ROUNDS round(s) of $# test file(s) or arguments, $LOAD busy processes on $(nproc) cores; reports in $SOAK_DIR"
started=$(date +%s)
failed_rounds=0
for round in $(seq 1 "$ROUNDS"); do
    out="$SOAK_DIR/round$round"
    mkdir -p "$out"
    t0=$(date +%s)
    status=0
    "$PYTHON" -m pytest -q -p no:cacheprovider --basetemp="$out/tmp" --junitxml="$out/junit.xml" "$@" \
        > "$out/log" 2>&1 || status=$?
    summary=$(tail -n 1 "$out/log")
    echo "round $round: $summary ($(( $(date +%s) - t0 )) s)"
    if [ "$status" -ne 0 ]; then
        failed_rounds=$((failed_rounds + 1))
        "$PYTHON" - "$out/junit.xml" <<'EOF' | sed 's/^/    /'
import sys
import xml.etree.ElementTree as ET

for case in ET.parse(sys.argv[1]).iter("testcase"):
    for bad in list(case.iter("failure")) + list(case.iter("error")):
        message = (bad.get("message") or "").splitlines()[:1]
        print(f"FAILED {case.get('classname')}::{case.get('name')}: {message[0] if message else ''}"[:400])
EOF
        mkdir -p "$out/stacks"
        find "$out/tmp" \( -path '*/hung/*.txt' -o -path '*/stalls/*.txt' \) -type f 2>/dev/null | while read -r f; do
            cp "$f" "$out/stacks/$(echo "${f#"$out/tmp/"}" | tr '/' '_')"
        done
        echo "    log: $out/log; stacks: $out/stacks ($(find "$out/stacks" -type f | wc -l) file(s))"
    fi
    rm -rf "$out/tmp"
done
echo "soak: $ROUNDS round(s), $failed_rounds failed, $(( $(date +%s) - started )) s in all"
[ "$failed_rounds" -eq 0 ]
