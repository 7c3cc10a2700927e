#!/bin/sh
# Worker image entrypoint: fill in the two settings that only the running container knows, then
# exec the command (tini is PID 1 above us and forwards signals).
#
# A worker advertises a gRPC address and a worker id through the Redis registry. Compose replicas
# (`docker-compose up --scale decode=3`) share one service definition, so neither can be written
# there; Kubernetes sets both from the downward API instead, and any value already set wins.
set -eu

if [ "${1:-}" = dsaserve ] && { [ "${2:-}" = prefill ] || [ "${2:-}" = decode ]; }; then
    if [ -z "${DSASERVE_ADVERTISE_HOST:-}" ]; then
        DSASERVE_ADVERTISE_HOST=$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')
        export DSASERVE_ADVERTISE_HOST
    fi
    if [ -z "${DSASERVE_WORKER_ID:-}" ]; then
        DSASERVE_WORKER_ID="$2-$(cat /etc/hostname)"
        export DSASERVE_WORKER_ID
    fi
fi
exec "$@"
