#!/bin/bash
# Run "$@"; rank 1 (RANK, as hpc run exports it) gets a /dev/shm of its own, as a rank
# in its own container has: the ranks then cannot see each other's shared memory.
set -euo pipefail
if [ "${RANK:-0}" = 1 ]; then
  exec unshare -m sh -c 'mount -t tmpfs tmpfs /dev/shm && exec "$@"' sh "$@"
fi
exec "$@"
