# Sourced by scripts/cluster.sh and scripts/cluster-stop.sh: where `make cluster` puts
# things. Override with AENV_CLUSTER_DIR, CLUSTER_PORT, CLUSTER_REDIS_PORT, AENV_CACHE_HOME.
DIR=${AENV_CLUSTER_DIR:-/var/lib/aenv-cluster}
CACHE=${AENV_CACHE_HOME:-/var/lib/aenv}      # make run's kernel and base image
SHARED="$DIR/shared"                          # the shared store of both nodes
GATEWAY_PORT=${CLUSTER_PORT:-3100}
N1_PORT=$((GATEWAY_PORT + 1))
N2_PORT=$((GATEWAY_PORT + 2))
REDIS_PORT=${CLUSTER_REDIS_PORT:-6390}
REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
GATEWAY_URL="http://127.0.0.1:$GATEWAY_PORT"
NODES="n1 n2"
