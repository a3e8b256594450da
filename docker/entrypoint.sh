#!/bin/sh
# The image's entrypoint. As root (docker's default) it brings up softverbs0
# on the container's network device and creates /dev/infiniband for it, then
# runs the command as SOFTVERBS_USER (default `rdma`, uid 1000; `root` keeps
# root). The unprivileged user needs no namespace: docker's seccomp profile
# forbids user namespaces, and `softverbs run` falls back to its environment.
set -eu
netdev=${SOFTVERBS_NETDEV:-}
if [ -z "$netdev" ]; then
  if [ -e /sys/class/net/eth0 ]; then netdev=eth0; else netdev=lo; fi
fi
user=${SOFTVERBS_USER:-rdma}

if [ "$(id -u)" -ne 0 ]; then
  if ! ls /dev/infiniband/uverbs* >/dev/null 2>&1; then
    echo "softverbs-entrypoint: started as uid $(id -u) (docker run --user?), so nothing could prepare" >&2
    echo "/dev/infiniband. Start the container as root (the default): the entrypoint prepares the device" >&2
    echo "and runs the command as the unprivileged user rdma (uid 1000); SOFTVERBS_USER names another." >&2
    exit 1
  fi
  softverbs up --netdev "$netdev" >/dev/null
  exec "$@"
fi

# Root's device only serves to create /dev/infiniband/uverbsN (which `down`
# leaves in place); each user's devices live in their own runtime directory.
softverbs up --netdev "$netdev" >/dev/null
if [ "$user" = root ]; then
  exec "$@"
fi
softverbs down >/dev/null
home=$(getent passwd "$user" | cut -d: -f6)
exec setpriv --reuid "$user" --regid "$user" --init-groups \
  env HOME="$home" USER="$user" LOGNAME="$user" PATH="$PATH" \
  sh -c 'softverbs up --netdev "$1" >/dev/null && shift && exec "$@"' sh "$netdev" "$@"
