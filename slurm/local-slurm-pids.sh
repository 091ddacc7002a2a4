# Shared by start-local-slurm.sh and stop-local-slurm.sh (sourced, not run).
# alive_as NAME PID: PID exists, its comm is NAME, and at least one of its
# threads is not a zombie.  (The leader of an exiting multi-threaded daemon
# shows State Z while other threads still work; a fully dead daemon can stay
# a zombie for a while when PID 1 is slow to reap it.)
alive_as() {
    local name=$1 pid=$2 t st
    [ -d "/proc/$pid" ] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 1
    for t in /proc/"$pid"/task/*; do
        st=$(awk '/^State:/ {print $2; exit}' "$t/status" 2>/dev/null || true)
        case "$st" in ""|Z|X) ;; *) return 0 ;; esac
    done
    return 1
}

# pid_ours NAME PIDFILE -> prints pid and returns 0 if PIDFILE names a live
# process whose comm is NAME.
pid_ours() {
    local name=$1 pidfile=$2 pid
    [ -s "$pidfile" ] || return 1
    pid=$(tr -dc '0-9' < "$pidfile")
    [ -n "$pid" ] && alive_as "$name" "$pid" || return 1
    echo "$pid"
}
