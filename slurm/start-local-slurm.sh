#!/usr/bin/env bash
# start-local-slurm.sh -- bring up a real single-node SLURM cluster on localhost.
#
# fixres_dist's copy of our workplace's local-SLURM script: .ci/run starts the cluster with it
# before the tests (tests/jobs/test_slurm.py runs real submitit and sbatch jobs on it) and stops it with
# slurm/stop-local-slurm.sh afterwards.  Needs root and apt-get (Debian 12 packages) the first time.
#
# Idempotent: installs the Debian packages if missing, (re)writes the config,
# starts munged, (optionally) a private MariaDB + slurmdbd, slurmctld and
# slurmd, and waits until the node is idle.  Running it again while the
# cluster is up is a no-op (or a restart of the SLURM daemons if the generated
# config changed).  Stop with stop-local-slurm.sh (kills only what this
# script started, using the PID files under $LOCAL_SLURM_DIR/run).
#
# Tested on Debian 12 (bookworm), slurm-wlm 22.05.8, munge 0.5.15,
# mariadb 10.11, as root, without systemd (PID 1 is not systemd).
#
# Settings (environment variables, all optional):
#   LOCAL_SLURM_DIR          state/spool/log/pid/db dir       [/tmp/local-slurm]
#   LOCAL_SLURM_ACCOUNTING   1: MariaDB+slurmdbd so `sacct` works (submitit
#                            uses sacct for job states); 0: no accounting  [1]
#   LOCAL_SLURM_CPUS         CPUs advertised for the node; may exceed the
#                            real count (SlurmdParameters=config_overrides)  [real count]
#   LOCAL_SLURM_MEM_MB       RealMemory of the node            [slurmd -C value]
#   LOCAL_SLURM_PARTITION    partition name (default partition)         [debug]
#   LOCAL_SLURM_CLUSTER      ClusterName                         [localcluster]
#   LOCAL_SLURM_OVERSUBSCRIBE partition OverSubscribe value      [FORCE:4]
#   LOCAL_SLURM_CRED_EXPIRE  AuthInfo cred_expire (s); also the delay before
#                            a requeued job may restart (min 5)            [10]
#   LOCAL_SLURM_KILL_WAIT    KillWait (s) between SIGTERM and SIGKILL; submitit
#                            jobs ignore SIGTERM, so scancel takes this long  [5]
#   LOCAL_SLURM_DB_PORT      TCP port of the private MariaDB (127.0.0.1)   [13306]
#   LOCAL_SLURM_WAIT_TIMEOUT seconds to wait for each daemon              [60]
#   LOCAL_SLURM_INSTALL      0: never run apt-get (fail if packages missing) [1]
#   LOCAL_SLURM_FORCE        1: overwrite an /etc/slurm/slurm.conf that this
#                            script did not write                          [0]
#   LOCAL_SLURM_CLEAN        1: wipe job/node state + accounting DB before
#                            starting (only when nothing of ours is running);
#                            job ids then restart at 1                      [0]
#   LOCAL_SLURM_SMOKE        1: finish with `srun -n 1 hostname` as a check  [1]
set -euo pipefail

BASE=${LOCAL_SLURM_DIR:-/tmp/local-slurm}
ACCOUNTING=${LOCAL_SLURM_ACCOUNTING:-1}
PARTITION=${LOCAL_SLURM_PARTITION:-debug}
CLUSTER=${LOCAL_SLURM_CLUSTER:-localcluster}
OVERSUBSCRIBE=${LOCAL_SLURM_OVERSUBSCRIBE:-FORCE:4}
CRED_EXPIRE=${LOCAL_SLURM_CRED_EXPIRE:-10}
KILL_WAIT=${LOCAL_SLURM_KILL_WAIT:-5}
DB_PORT=${LOCAL_SLURM_DB_PORT:-13306}
WAIT_TIMEOUT=${LOCAL_SLURM_WAIT_TIMEOUT:-60}
INSTALL=${LOCAL_SLURM_INSTALL:-1}
FORCE=${LOCAL_SLURM_FORCE:-0}
CLEAN=${LOCAL_SLURM_CLEAN:-0}
SMOKE=${LOCAL_SLURM_SMOKE:-1}

CONF_DIR=/etc/slurm                 # default location: clients need no SLURM_CONF
SLURM_CONF_FILE=$CONF_DIR/slurm.conf
DBD_CONF_FILE=$CONF_DIR/slurmdbd.conf
MARKER="# managed-by: start-local-slurm.sh"
RUN=$BASE/run
LOG=$BASE/log
DB_USER=slurm
DB_PASS=slurm-local-only
DB_NAME=slurm_acct_db

T_START=$(date +%s.%N)
log() { printf '[start-local-slurm %6.2fs] %s\n' "$(echo "$(date +%s.%N) - $T_START" | awk '{print $1 - $3}')" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root"
unset SLURM_CONF   # use $SLURM_CONF_FILE (the default path) everywhere

# ---------------------------------------------------------------- helpers ---
. "$(dirname "$0")/local-slurm-pids.sh"  # alive_as, pid_ours

# stop_ours NAME PIDFILE [TIMEOUT]: SIGTERM, wait, SIGKILL; only that PID.
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
            log "$name (pid $pid) ignored SIGTERM for ${timeout}s; SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$pidfile"
}

# wait_for DESCRIPTION LOGFILE CMD...: poll CMD every 0.1 s up to WAIT_TIMEOUT.
wait_for() {
    local what=$1 logfile=$2; shift 2
    local deadline=$(( $(date +%s) + WAIT_TIMEOUT ))
    until "$@" >/dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            log "timed out after ${WAIT_TIMEOUT}s waiting for $what"
            [ -f "$logfile" ] && { log "last lines of $logfile:"; tail -n 30 "$logfile" >&2; }
            exit 1
        fi
        sleep 0.1
    done
    log "$what: ok"
}

pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

# ---------------------------------------------------------------- install ---
mkdir -p "$BASE" "$RUN" "$LOG"
PKGS="slurmctld slurmd slurm-client munge"
[ "$ACCOUNTING" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
MISSING=""
for p in $PKGS; do pkg_installed "$p" || MISSING="$MISSING $p"; done
if [ -n "$MISSING" ]; then
    [ "$INSTALL" = 1 ] || die "missing packages:$MISSING (LOCAL_SLURM_INSTALL=0)"
    log "installing:$MISSING"
    # Keep maintainer scripts from starting the packaged services (systemd /
    # sysv): we run our own instances.  Only if no policy-rc.d exists yet.
    TMP_POLICY=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        TMP_POLICY=/usr/sbin/policy-rc.d
    fi
    export DEBIAN_FRONTEND=noninteractive
    APT_OPTS=(-o DPkg::Lock::Timeout=300 -o Dpkg::Options::=--force-confold)
    APT_LOG=$LOG/apt-install.log
    apt-get "${APT_OPTS[@]}" update > "$APT_LOG" 2>&1 || log "apt-get update failed (continuing; see $APT_LOG)"
    # shellcheck disable=SC2086
    if ! apt-get "${APT_OPTS[@]}" install -y --no-install-recommends $MISSING >> "$APT_LOG" 2>&1; then
        [ -n "$TMP_POLICY" ] && rm -f "$TMP_POLICY"
        tail -n 30 "$APT_LOG" >&2
        die "apt-get install failed (full log: $APT_LOG)"
    fi
    [ -n "$TMP_POLICY" ] && rm -f "$TMP_POLICY"
    # shellcheck disable=SC2086
    log "packages installed: $(dpkg-query -W -f='${Package}=${Version} ' $PKGS)"
fi
for c in slurmctld slurmd sbatch srun sinfo squeue scontrol munged munge unmunge; do
    command -v "$c" >/dev/null || die "$c not found after install"
done

# ---------------------------------------------------------------- layout ----
mkdir -p "$BASE" "$RUN" "$LOG" "$BASE/state" "$BASE/spool" "$CONF_DIR"
chmod 755 "$BASE" "$RUN" "$LOG"

if [ "$CLEAN" = 1 ]; then
    if pid_ours slurmctld "$RUN/slurmctld.pid" >/dev/null || pid_ours slurmd "$RUN/slurmd.pid" >/dev/null \
        || pid_ours slurmdbd "$RUN/slurmdbd.pid" >/dev/null || pid_ours mariadbd "$RUN/mariadbd.pid" >/dev/null; then
        die "LOCAL_SLURM_CLEAN=1 but daemons are running; run stop-local-slurm.sh first"
    fi
    log "LOCAL_SLURM_CLEAN=1: wiping $BASE/{state,spool,mysql}"
    rm -rf "$BASE/state" "$BASE/spool" "$BASE/mysql"
    mkdir -p "$BASE/state" "$BASE/spool"
fi

# ---------------------------------------------------------------- munge -----
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile=/etc/munge/munge.key --force
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
fi
chown munge:munge /etc/munge /etc/munge/munge.key
chmod 0700 /etc/munge
chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0700 /var/log/munge

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if pid_ours munged "$RUN/munged.pid" >/dev/null; then
    log "munged already running (ours, pid $(cat "$RUN/munged.pid"))"
elif munge_works; then
    log "munged already running (not started by this script; left alone)"
else
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged   # forks; writes /run/munge/munged.pid
    wait_for "munged" /var/log/munge/munged.log munge_works
    cp /run/munge/munged.pid "$RUN/munged.pid"   # marks it as ours for stop script
    log "munged started (pid $(cat "$RUN/munged.pid"))"
fi

# ---------------------------------------------------------------- node facts -
NODE=$(hostname -s)
[ -n "$NODE" ] || die "empty hostname"
# slurmd -C prints e.g. "NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105"
HW=$(slurmd -C 2>/dev/null | head -n 1 || true)
HW_CPUS=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<< "$HW")
HW_MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<< "$HW")
[ -n "$HW_CPUS" ] || HW_CPUS=$(nproc)
[ -n "$HW_MEM" ] || HW_MEM=$(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo)
CPUS=${LOCAL_SLURM_CPUS:-$HW_CPUS}
MEM=${LOCAL_SLURM_MEM_MB:-$HW_MEM}
log "node $NODE: hw CPUs=$HW_CPUS RealMemory=$HW_MEM -> configured CPUs=$CPUS RealMemory=$MEM"

# ---------------------------------------------------------------- configs ---
if [ "$ACCOUNTING" = 1 ]; then
    ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
    ACCT_LINES="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi

NEW_CONF=$(cat <<EOF
$MARKER (regenerated on every start; edit the script instead)
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=$CRED_EXPIRE
CredType=cred/munge
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: plain process tracking, no task binding/containment
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobContainerType=job_container/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# schedule batch jobs immediately; re-scan pending jobs every 2 s
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=5
# trust CPUs/RealMemory below even if they exceed the hardware
SlurmdParameters=config_overrides
$ACCT_LINES
JobCompType=jobcomp/none
ReturnToService=2
KillWait=$KILL_WAIT
MinJobAge=300
MailProg=/bin/true
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=$OVERSUBSCRIBE
EOF
)

NEW_DBD_CONF=$(cat <<EOF
$MARKER (regenerated on every start)
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
)

check_managed() {
    local f=$1
    if [ -e "$f" ] && ! grep -qF "$MARKER" "$f" && [ "$FORCE" != 1 ]; then
        die "$f exists and was not written by this script (set LOCAL_SLURM_FORCE=1 to overwrite)"
    fi
}
check_managed "$SLURM_CONF_FILE"
[ "$ACCOUNTING" = 1 ] && check_managed "$DBD_CONF_FILE"

CONF_CHANGED=0
if [ "$(cat "$SLURM_CONF_FILE" 2>/dev/null)" != "$NEW_CONF" ]; then
    CONF_CHANGED=1
fi
DBD_CONF_CHANGED=0
if [ "$ACCOUNTING" = 1 ] && [ "$(cat "$DBD_CONF_FILE" 2>/dev/null)" != "$NEW_DBD_CONF" ]; then
    DBD_CONF_CHANGED=1
fi

# A changed config needs a restart of the daemons that read it (cred_expire,
# ports, node definition are only read at startup).
if [ "$CONF_CHANGED" = 1 ]; then
    stop_ours slurmd "$RUN/slurmd.pid"
    stop_ours slurmctld "$RUN/slurmctld.pid"
    printf '%s\n' "$NEW_CONF" > "$SLURM_CONF_FILE.tmp.$$"
    chmod 644 "$SLURM_CONF_FILE.tmp.$$"
    mv "$SLURM_CONF_FILE.tmp.$$" "$SLURM_CONF_FILE"
    log "wrote $SLURM_CONF_FILE"
fi
if [ "$DBD_CONF_CHANGED" = 1 ]; then
    stop_ours slurmdbd "$RUN/slurmdbd.pid"
    (umask 077; printf '%s\n' "$NEW_DBD_CONF" > "$DBD_CONF_FILE.tmp.$$")
    chown root:root "$DBD_CONF_FILE.tmp.$$"   # must be owned by SlurmUser, mode 600
    chmod 600 "$DBD_CONF_FILE.tmp.$$"
    mv "$DBD_CONF_FILE.tmp.$$" "$DBD_CONF_FILE"
    log "wrote $DBD_CONF_FILE"
fi

# ---------------------------------------------------------------- mariadb + slurmdbd
if [ "$ACCOUNTING" = 1 ]; then
    for c in slurmdbd mariadbd mariadb-install-db mariadb mariadb-admin sacct sacctmgr; do
        command -v "$c" >/dev/null || die "$c not found"
    done
    DB_DIR=$BASE/mysql
    DB_SOCK=$RUN/mysqld.sock
    MARIADB_OPTS=(--no-defaults --datadir="$DB_DIR" --innodb-log-file-size=8M
                  --innodb-data-file-path=ibdata1:12M:autoextend)
    db_ping() { mariadb-admin --no-defaults --socket="$DB_SOCK" -uroot ping; }

    if pid_ours mariadbd "$RUN/mariadbd.pid" >/dev/null; then
        log "mariadbd already running (ours, pid $(cat "$RUN/mariadbd.pid"))"
    else
        if [ ! -d "$DB_DIR/mysql" ]; then
            log "initialising MariaDB datadir $DB_DIR"
            rm -rf "$DB_DIR"; mkdir -p "$DB_DIR"
            mariadb-install-db "${MARIADB_OPTS[@]}" --user=root \
                --auth-root-authentication-method=socket --skip-test-db \
                > "$LOG/mariadb-install-db.log" 2>&1 \
                || { tail -n 30 "$LOG/mariadb-install-db.log" >&2; die "mariadb-install-db failed"; }
        fi
        rm -f "$DB_SOCK" "$RUN/mariadbd.pid"
        # mariadbd does not daemonise: detach it ourselves
        setsid /usr/sbin/mariadbd "${MARIADB_OPTS[@]}" --user=root \
            --socket="$DB_SOCK" --port="$DB_PORT" --bind-address=127.0.0.1 \
            --pid-file="$RUN/mariadbd.pid" --log-error="$LOG/mariadbd.log" \
            --innodb-buffer-pool-size=64M --skip-name-resolve \
            --performance-schema=OFF --skip-log-bin \
            </dev/null >/dev/null 2>&1 &
        wait_for "mariadbd on 127.0.0.1:$DB_PORT" "$LOG/mariadbd.log" db_ping
    fi
    mariadb --no-defaults --socket="$DB_SOCK" -uroot <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'127.0.0.1';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
EOF

    if pid_ours slurmdbd "$RUN/slurmdbd.pid" >/dev/null; then
        log "slurmdbd already running (ours, pid $(cat "$RUN/slurmdbd.pid"))"
    else
        slurmdbd   # daemonises; PidFile=$RUN/slurmdbd.pid
        # sacctmgr talks to slurmdbd directly (needs slurm.conf with slurmdbd)
        wait_for "slurmdbd on 127.0.0.1:6819" "$LOG/slurmdbd.log" sacctmgr -n -P show cluster
    fi
fi

# ---------------------------------------------------------------- slurmctld --
ctld_up() { scontrol ping | grep -q 'is UP'; }
if pid_ours slurmctld "$RUN/slurmctld.pid" >/dev/null; then
    log "slurmctld already running (ours, pid $(cat "$RUN/slurmctld.pid"))"
else
    slurmctld   # daemonises; SlurmctldPidFile=$RUN/slurmctld.pid
    wait_for "slurmctld" "$LOG/slurmctld.log" ctld_up
fi

# ---------------------------------------------------------------- slurmd ----
node_state() { sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n 1 || true; }
node_ready() { case "$(node_state)" in idle|mixed|allocated|completing) return 0;; *) return 1;; esac; }
if pid_ours slurmd "$RUN/slurmd.pid" >/dev/null; then
    log "slurmd already running (ours, pid $(cat "$RUN/slurmd.pid"))"
else
    slurmd      # daemonises; SlurmdPidFile=$RUN/slurmd.pid
fi
# A node left DOWN/DRAINED by an earlier unclean stop is brought back.
deadline=$(( $(date +%s) + WAIT_TIMEOUT ))
until node_ready; do
    st=$(node_state)
    case "$st" in
        down*|drain*|fail*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    if [ "$(date +%s)" -ge "$deadline" ]; then
        log "node $NODE not ready after ${WAIT_TIMEOUT}s (state '$st')"
        scontrol show node "$NODE" >&2 || true
        tail -n 30 "$LOG/slurmd.log" >&2 || true
        exit 1
    fi
    sleep 0.1
done
log "node $NODE is $(node_state)"

if [ "$ACCOUNTING" = 1 ]; then
    # slurmctld registers the cluster in slurmdbd by itself; wait for it so
    # that the very first sacct call already works.
    wait_for "cluster '$CLUSTER' registered in slurmdbd" "$LOG/slurmctld.log" \
        bash -c "sacctmgr -n -P show cluster format=cluster | grep -qx '$CLUSTER'"
fi

if [ "$SMOKE" = 1 ]; then
    # End-to-end check: munge auth, allocation, slurmd -> slurmstepd launch.
    # Retried: after a slurmctld crash (SIGKILL) the job id counter can go
    # back and the first new job may hit "Job credential revoked".
    ok=0
    for attempt in 1 2 3; do
        if out=$(timeout 60 srun -J local-slurm-smoke -N 1 -n 1 -t 1 hostname 2>&1); then
            ok=1; break
        fi
        log "smoke test attempt $attempt failed: $out"
        sleep 1
    done
    if [ "$ok" = 1 ]; then
        log "smoke test 'srun -n 1 hostname': $out"
    else
        tail -n 30 "$LOG/slurmd.log" >&2
        die "smoke test failed"
    fi
fi

cat > "$BASE/env.sh" <<EOF
# source this file for information only; /etc/slurm/slurm.conf is the default
# path, so no SLURM_CONF is needed.
export LOCAL_SLURM_DIR=$BASE
export LOCAL_SLURM_NODE=$NODE
export LOCAL_SLURM_PARTITION=$PARTITION
export LOCAL_SLURM_CPUS=$CPUS
EOF

sinfo >&2
log "cluster '$CLUSTER' ready: partition '$PARTITION', node $NODE, CPUs=$CPUS, accounting=$ACCOUNTING; logs in $LOG"
