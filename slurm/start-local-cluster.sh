#!/usr/bin/env bash
# start-local-cluster.sh -- N cluster "nodes" on this machine, optionally with a multi-node SLURM.
#
#   bash slurm/start-local-cluster.sh [--nodes N] [--slurm]
#
# Each node is a Linux network namespace (fxnode1..N) with one veth link to a bridge (fxbr,
# 10.78.0.254/24 on this machine's side); node i has the address 10.78.0.i, its own hostname n<i>
# (a UTS namespace, see slurm/on-node.sh) and an /etc/hosts that maps its own name to 127.0.1.1,
# as Debian and Ubuntu do by default, and every other node's name to its bridge address. The nodes
# share this machine's filesystem, as cluster nodes share NFS. There is no default route in the
# namespaces: a node reaches its loopback, the other nodes and this machine's bridge address only.
#
# --slurm also starts a multi-node SLURM on them: the single-node SLURM's munged and slurmdbd
# (slurm/start-local-slurm.sh, started if needed), a second slurmctld in this machine's namespace on
# the bridge (port 6827, cluster "fixrescluster"), and one slurmd per node inside its namespace.
# Its clients need SLURM_CONF=$LOCAL_CLUSTER_DIR/slurm.conf (printed at the end).
#
# Idempotent: a node or daemon that is up is left alone. Stop with slurm/stop-local-cluster.sh.
# Needs root (ip netns, veth, bridge); prints one line and exits 1 where that is refused.
#
# Settings: LOCAL_CLUSTER_DIR (state, logs, pids, slurm.conf) [/tmp/local-cluster],
#           LOCAL_CLUSTER_CPUS (CPUs advertised per node) [2], LOCAL_CLUSTER_WAIT_TIMEOUT [60].
# The recipe this follows, verified on this machine kind: ../shared/slurm/MULTINODE.md.
set -euo pipefail

NODES=2
SLURM=0
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES=${2:-}; shift $(( $# > 1 ? 2 : 1 )) ;;
        --slurm) SLURM=1; shift ;;
        *) echo "usage: $0 [--nodes N] [--slurm]" >&2; exit 2 ;;
    esac
done
[[ "$NODES" =~ ^[1-9][0-9]?$ ]] && [ "$NODES" -le 250 ] || { echo "start-local-cluster: --nodes must be 1-250" >&2; exit 2; }

HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${LOCAL_CLUSTER_DIR:-/tmp/local-cluster}
CPUS=${LOCAL_CLUSTER_CPUS:-2}
WAIT_TIMEOUT=${LOCAL_CLUSTER_WAIT_TIMEOUT:-60}
BRIDGE=fxbr
NET=10.78.0
CONF=$BASE/slurm.conf
RUN=$BASE/run
LOG=$BASE/log
CLUSTER=fixrescluster
log() { echo "[start-local-cluster] $*" >&2; }
die() { echo "start-local-cluster: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces, veth pairs, a bridge)"
for c in ip nsenter unshare; do command -v "$c" >/dev/null || die "$c not found"; done
mkdir -p "$BASE" "$RUN" "$LOG"

# ------------------------------------------------------------------ nodes
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge 2>/dev/null || die "cannot create the bridge $BRIDGE (ip link add ... type bridge refused)"
    ip addr add "$NET.254/24" dev "$BRIDGE"
fi
ip link set "$BRIDGE" up
hosts_for() {  # the /etc/hosts node $1 sees
    local i
    printf '127.0.0.1 localhost\n127.0.1.1 n%s\n' "$1"
    for ((i = 1; i <= NODES; i++)); do [ "$i" = "$1" ] || printf '%s.%s n%s\n' "$NET" "$i" "$i"; done
    printf '%s.254 %s\n' "$NET" "$(hostname)"
}
for ns in $(ip netns list | awk '$1 ~ /^fxnode[0-9]+$/ {print $1}'); do  # nodes beyond N, from a larger start
    if [ "${ns#fxnode}" -gt "$NODES" ]; then
        pids=$(ip netns pids "$ns"); [ -n "$pids" ] && kill -KILL $pids
        ip netns del "$ns"; rm -rf "/etc/netns/$ns"
    fi
done
link_node() {  # node $1's link: this machine's end fxv$1 on the bridge, the node's end fxp$1 in namespace $2
    ip link del "fxv$1" 2>/dev/null || true  # a removed node's link that lingers
    ip netns exec "$2" ip link del "fxp$1" 2>/dev/null || true
    ip link add "fxv$1" type veth peer name "fxp$1"
    ip link set "fxp$1" netns "$2"
    ip link set "fxv$1" master "$BRIDGE"
    ip netns exec "$2" ip addr add "$NET.$1/24" dev "fxp$1"
}
for ((i = 1; i <= NODES; i++)); do
    ns=fxnode$i
    if ! ip netns list | grep -qw "$ns"; then
        ip netns add "$ns" || die "cannot create the network namespace $ns"
        link_node "$i" "$ns"
        ip netns exec "$ns" ip link set lo up
    elif ! ip link show "fxv$i" >/dev/null 2>&1; then  # a node whose link went with a removal under way
        link_node "$i" "$ns"
    fi
    ip link set "fxv$i" up
    ip netns exec "$ns" ip link set "fxp$i" up
    mkdir -p "/etc/netns/$ns"
    hosts_for "$i" > "/etc/netns/$ns/hosts"
done
log "$NODES node(s) up: n1..n$NODES = $NET.1..$NET.$NODES on bridge $BRIDGE ($NET.254); run a command on node i with slurm/on-node.sh i CMD"
[ "$SLURM" = 1 ] || exit 0

# ------------------------------------------------------------------ SLURM across the nodes
. "$HERE/local-slurm-pids.sh"  # alive_as, pid_ours
LOCAL_SLURM_SMOKE=0 bash "$HERE/start-local-slurm.sh" > "$LOG/start-local-slurm.log" 2>&1 \
    || die "slurm/start-local-slurm.sh failed (munged/slurmdbd): $(tail -n 1 "$LOG/start-local-slurm.log")"
ACCT="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
if sacctmgr -n -P show cluster >/dev/null 2>&1; then  # the single-node SLURM's slurmdbd is up
    sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
    ACCT="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux"
fi
NODE_LINES=""
for ((i = 1; i <= NODES; i++)); do
    NODE_LINES+="NodeName=n$i NodeAddr=$NET.$i NodeHostname=n$i CPUs=$CPUS RealMemory=4000 State=UNKNOWN"$'\n'
done
NEW_CONF="# managed-by: start-local-cluster.sh (regenerated on every start)
ClusterName=$CLUSTER
SlurmctldHost=$(hostname -s)($NET.254)
SlurmctldPort=6827
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobContainerType=job_container/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=5
SlurmdParameters=config_overrides
$ACCT
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=30
KillWait=5
MinJobAge=300
MailProg=/bin/true
${NODE_LINES}PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
mkdir -p "$BASE/state"
if [ "$(cat "$CONF" 2>/dev/null)" != "$NEW_CONF" ]; then
    bash "$HERE/stop-local-cluster.sh" --daemons-only >/dev/null 2>&1 || true
    printf '%s\n' "$NEW_CONF" > "$CONF.tmp.$$" && chmod 644 "$CONF.tmp.$$" && mv "$CONF.tmp.$$" "$CONF"
fi
export SLURM_CONF=$CONF
wait_for() {  # DESCRIPTION CMD...: poll CMD every 0.2 s up to WAIT_TIMEOUT
    local what=$1 deadline=$(( $(date +%s) + WAIT_TIMEOUT )); shift
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$deadline" ] || die "timed out after ${WAIT_TIMEOUT}s waiting for $what (logs in $LOG)"
        sleep 0.2
    done
}
pid_ours slurmctld "$RUN/slurmctld.pid" >/dev/null || slurmctld -f "$CONF"
wait_for "slurmctld" bash -c "scontrol ping | grep -q 'is UP'"
for ((i = 1; i <= NODES; i++)); do
    pid_ours slurmd "$RUN/slurmd-n$i.pid" >/dev/null || bash "$HERE/on-node.sh" "$i" slurmd -f "$CONF" -N "n$i"
done
nodes_idle() {
    local states
    states=$(sinfo -h -N -p debug -o '%N %T' 2>/dev/null) || return 1
    for ((i = 1; i <= NODES; i++)); do
        case "$(awk -v n="n$i" '$1 == n {print $2}' <<< "$states")" in
            idle|mixed|allocated|completing) ;;
            down*|drain*|fail*) scontrol update NodeName="n$i" State=RESUME >/dev/null 2>&1; return 1 ;;
            *) return 1 ;;
        esac
    done
}
wait_for "nodes n1..n$NODES to be idle" nodes_idle
log "SLURM cluster $CLUSTER up: $(sinfo -h -o '%D node(s) %N %T' | head -n 1); use SLURM_CONF=$CONF"
