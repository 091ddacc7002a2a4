#!/usr/bin/env bash
# stop-local-slurm.sh -- stop the daemons that start-local-slurm.sh started.
#
# fixres_dist's copy of our workplace's local-SLURM script (see start-local-slurm.sh).
#
# Only PIDs recorded in $LOCAL_SLURM_DIR/run/*.pid are signalled, and only if
# /proc/PID/comm still matches the expected daemon name.  A munged that was
# already running before start-local-slurm.sh (no run/munged.pid) is left
# alone.  Nothing is killed by name.
#
#   LOCAL_SLURM_DIR          same as for the start script   [/tmp/local-slurm]
#   LOCAL_SLURM_CANCEL_JOBS  1: scancel all jobs of the (private) cluster
#                            first, so no slurmstepd/job processes outlive
#                            slurmd                              [1]
#   --purge                  afterwards delete $LOCAL_SLURM_DIR (state,
#                            logs, accounting DB) and the generated configs
set -uo pipefail

BASE=${LOCAL_SLURM_DIR:-/tmp/local-slurm}
RUN=$BASE/run
CANCEL_JOBS=${LOCAL_SLURM_CANCEL_JOBS:-1}
PURGE=0
for a in "$@"; do
    case "$a" in
        --purge) PURGE=1 ;;
        *) echo "usage: $0 [--purge]" >&2; exit 2 ;;
    esac
done
MARKER="# managed-by: start-local-slurm.sh"
T_START=$(date +%s.%N)
log() { printf '[stop-local-slurm %6.2fs] %s\n' "$(echo "$(date +%s.%N) - $T_START" | awk '{print $1 - $3}')" "$*" >&2; }
unset SLURM_CONF

. "$(dirname "$0")/local-slurm-pids.sh"  # alive_as, pid_ours

stop_ours() {
    local name=$1 pidfile=$2 timeout=${3:-20} pid i
    if pid=$(pid_ours "$name" "$pidfile"); then
        log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < timeout * 10; i++)); do
            alive_as "$name" "$pid" || break
            sleep 0.1
        done
        if alive_as "$name" "$pid"; then
            log "$name (pid $pid) still alive after ${timeout}s; SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    else
        [ -e "$pidfile" ] && log "$name: stale pid file $pidfile"
    fi
    rm -f "$pidfile"
}

[ "$(id -u)" -eq 0 ] || { log "must run as root"; exit 1; }

# 1. cancel jobs while slurmctld/slurmd are still up, so job steps are torn down
if [ "$CANCEL_JOBS" = 1 ] && pid_ours slurmctld "$RUN/slurmctld.pid" >/dev/null; then
    jobs=$(squeue -h -o '%i' 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        for ((i = 0; i < 300; i++)); do
            [ -z "$(squeue -h -o '%i' 2>/dev/null)" ] && break
            sleep 0.1
        done
    fi
fi

# 2. daemons, in reverse start order
stop_ours slurmd "$RUN/slurmd.pid"
stop_ours slurmctld "$RUN/slurmctld.pid"
stop_ours slurmdbd "$RUN/slurmdbd.pid"
stop_ours mariadbd "$RUN/mariadbd.pid" 60
if [ -e "$RUN/munged.pid" ]; then
    stop_ours munged "$RUN/munged.pid"
fi

# 3. report (never kill) job step daemons that survived
left=$(ps -eo pid=,comm= | awk '$2 == "slurmstepd" {print $1}' | tr '\n' ' ')
[ -n "${left// /}" ] && log "note: slurmstepd processes still running: $left"

if [ "$PURGE" = 1 ]; then
    log "purging $BASE and generated configs"
    rm -rf "$BASE"
    for f in /etc/slurm/slurm.conf /etc/slurm/slurmdbd.conf; do
        [ -e "$f" ] && grep -qF "$MARKER" "$f" && rm -f "$f"
    done
fi
log "done"
