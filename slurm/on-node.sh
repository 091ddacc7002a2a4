#!/usr/bin/env bash
# on-node.sh I CMD [ARG...] -- run CMD on node I of slurm/start-local-cluster.sh.
#
# CMD runs in node I's network namespace (fxnode<I>), with its own hostname n<I> (a new UTS
# namespace) and the node's /etc/hosts bound over this machine's (a new mount namespace: nothing
# else changes; the filesystem is shared). Its environment is this one's. Needs root.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 NODE CMD [ARG...]" >&2; exit 2; }
node=$1; shift
[ -e "/var/run/netns/fxnode$node" ] || { echo "on-node: node $node does not exist (slurm/start-local-cluster.sh)" >&2; exit 1; }
# Not `ip netns exec`: it remounts /sys, and slurmd then finds no cgroup filesystem.
exec nsenter --net="/var/run/netns/fxnode$node" unshare --uts --mount \
    bash -c 'hostname "n$0" && mount --bind "/etc/netns/fxnode$0/hosts" /etc/hosts && exec "$@"' "$node" "$@"
