#!/usr/bin/env bash
# stop-local-cluster.sh [--daemons-only] -- undo slurm/start-local-cluster.sh.
#
# Cancels the multi-node SLURM's jobs, stops its slurmds and slurmctld (only the PIDs recorded in
# $LOCAL_CLUSTER_DIR/run whose command name still matches), kills what is left in the node
# namespaces, then deletes the namespaces, the bridge and /etc/netns/fxnode*. The single-node SLURM
# (slurm/start-local-slurm.sh), whose munged and slurmdbd the cluster borrowed, is left alone.
# --daemons-only: stop the SLURM daemons and keep the nodes.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${LOCAL_CLUSTER_DIR:-/tmp/local-cluster}
RUN=$BASE/run
. "$HERE/local-slurm-pids.sh"  # alive_as, pid_ours
[ "$(id -u)" -eq 0 ] || { echo "stop-local-cluster: must run as root" >&2; exit 1; }

stop_ours() {  # NAME PIDFILE: SIGTERM, up to 10 s, then SIGKILL
    local pid i
    pid=$(pid_ours "$1" "$2") || { rm -f "$2"; return 0; }
    kill -TERM "$pid" 2>/dev/null
    for ((i = 0; i < 100; i++)); do alive_as "$1" "$pid" || break; sleep 0.1; done
    alive_as "$1" "$pid" && kill -KILL "$pid" 2>/dev/null
    rm -f "$2"
}
if [ -s "$BASE/slurm.conf" ] && pid_ours slurmctld "$RUN/slurmctld.pid" >/dev/null; then
    SLURM_CONF=$BASE/slurm.conf timeout 10 scancel --cluster=fixrescluster --full --signal=KILL --state=RUNNING >/dev/null 2>&1
    SLURM_CONF=$BASE/slurm.conf timeout 10 scancel --cluster=fixrescluster >/dev/null 2>&1
fi
for pidfile in "$RUN"/slurmd-*.pid; do [ -e "$pidfile" ] && stop_ours slurmd "$pidfile"; done
stop_ours slurmctld "$RUN/slurmctld.pid"
[ "${1:-}" = --daemons-only ] && exit 0

for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^fxnode[0-9]+$/ {print $1}'); do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
    ip netns del "$ns"
    rm -rf "/etc/netns/$ns"
done
ip link del fxbr 2>/dev/null
exit 0
