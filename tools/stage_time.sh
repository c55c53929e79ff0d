#!/usr/bin/env bash
# The wall time of each stage of `make test`, so a slow one is seen at once.
#
#   tools/stage_time.sh NAME -- COMMAND...   run COMMAND, exit with its status
#   tools/stage_time.sh --report START       the stages' times, slowest first
#
# NAME -- COMMAND: when STAGE_TIMES names a file (`make test` sets it), appends
#   "NAME SECONDS STATUS" to it after COMMAND. A stage of several commands runs
#   each through here under one NAME; the report sums them. One short line per
#   append, so parallel jobs (make -j2) never interleave within a line.
# --report START: the table of STAGE_TIMES, each stage's seconds and a failed
#   one's status, then the stages' sum and the wall time since START (seconds
#   since the epoch); the sum is the larger, as two jobs run at a time.
set -uo pipefail

if [ "${1:-}" = --report ]; then
    start="${2:?--report START: the start time in seconds since the epoch}"
    echo
    echo "make test: each stage's wall time, slowest first"
    if [ ! -s "${STAGE_TIMES:?}" ]; then
        echo "  no stage ran"
    else
        # Per stage: the seconds of its commands summed, the status of the last
        # that failed (a failing command ends its stage).
        awk '{ t[$1] += $2; if ($3 != 0) rc[$1] = $3 }
             END { for (s in t) printf "%s %d %d\n", s, t[s], rc[s] }' "$STAGE_TIMES" |
            sort -k2,2nr -k1,1 |
            awk '{ printf "  %-28s %5d s%s\n", $1, $2, ($3 ? "  FAILED (exit " $3 ")" : "")
                   sum += $2 }
                 END { printf "  %-28s %5d s\n", "stages, summed", sum }'
    fi
    printf "  %-28s %5d s\n" "make test, wall time" "$(( $(date +%s) - start ))"
    exit 0
fi

name="${1:?usage: tools/stage_time.sh NAME -- COMMAND...}"
[ "${2:-}" = -- ] && [ $# -ge 3 ] || { echo "usage: tools/stage_time.sh NAME -- COMMAND..." >&2; exit 2; }
shift 2
begin=$(date +%s)
status=0
"$@" || status=$?
if [ -n "${STAGE_TIMES:-}" ]; then
    echo "$name $(( $(date +%s) - begin )) $status" >> "$STAGE_TIMES"
fi
exit "$status"
