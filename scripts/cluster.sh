#!/usr/bin/env bash
# `make cluster`: a cluster on this host (issue 18): a Redis, two aenv nodes and one aenv
# gateway, each its own process, home, name prefix and address ranges, sharing the kernel
# and image cache of `make run` (AENV_CACHE_HOME) and one shared store (AENV_SHARED_STORE).
# Then scripts/cluster_demo.py drives them with the E2B Python SDK through the gateway:
# creates spread over both nodes, a fork, a pause on one node and its resume on the other
# (the first node stopped meanwhile, then started again). Stop it all: make cluster-stop.
#
# Everything lives below AENV_CLUSTER_DIR (default /var/lib/aenv-cluster): pid files,
# logs, homes, the shared store, the cluster secret. Ports: CLUSTER_PORT (gateway, 3100),
# +1 and +2 (nodes), CLUSTER_REDIS_PORT (6390). Running it again reuses what runs.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cluster-env.sh

AENV=.venv/bin/aenv
"$AENV" image build          # the kernel + base image, in AENV_CACHE_HOME (make run's)
mkdir -p "$DIR" "$SHARED"
chmod 0700 "$DIR"
[ -s "$DIR/cluster-secret" ] || ( umask 077; od -An -N24 -tx1 /dev/urandom | tr -d ' \n' > "$DIR/cluster-secret" )
export AENV_CLUSTER_SECRET; AENV_CLUSTER_SECRET=$(cat "$DIR/cluster-secret")

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_up() {  # NAME PIDFILE CHECK-COMMAND...
  local name=$1 pidfile=$2; shift 2
  for _ in $(seq 1 1500); do
    "$@" >/dev/null 2>&1 && return 0
    running "$pidfile" || { echo "cluster: $name exited; last lines of its log:" >&2
                            tail -20 "$DIR/$name.log" >&2; exit 1; }
    sleep 0.2
  done
  echo "cluster: $name did not come up" >&2; exit 1
}
spawn() {  # NAME COMMAND...: setsid, own log and pid file (cluster-stop.sh reads them)
  local name=$1; shift
  if running "$DIR/$name.pid"; then echo "cluster: $name already running"; return; fi
  echo "cluster: starting $name (log: $DIR/$name.log)"
  setsid nohup "$@" >>"$DIR/$name.log" 2>&1 < /dev/null &
  echo $! > "$DIR/$name.pid"
}

mkdir -p "$DIR/redis"
spawn redis redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$DIR/redis" --protected-mode yes
wait_up redis "$DIR/redis.pid" redis-cli -p "$REDIS_PORT" ping

start_node() {  # ID PORT NET: host addresses 10.NET.0.0/24, veths 10.(NET+1).0.0/24
  local id=$1 port=$2 net=$3
  mkdir -p "$DIR/$id"
  spawn "$id" env AENV_HOME="$DIR/$id" AENV_CACHE_HOME="$CACHE" AENV_NAME_PREFIX="aenv$id" \
    AENV_HOST_CIDR="10.$net.0.0/24" AENV_VETH_CIDR="10.$((net + 1)).0.0/24" AENV_WARM_SLOTS=2 \
    AENV_SHARED_STORE="$SHARED" AENV_DRAIN_TIMEOUT=20 \
    "$AENV" server --host 127.0.0.1 --port "$port" --cluster "$REDIS_URL" --node-id "$id" \
    --advertise "http://127.0.0.1:$port"
}
# Side by side: each start snapshots base (15-60 s under TCG).
start_node n1 "$N1_PORT" 91
start_node n2 "$N2_PORT" 93
wait_up n1 "$DIR/n1.pid" curl -fsS "http://127.0.0.1:$N1_PORT/health"
wait_up n2 "$DIR/n2.pid" curl -fsS "http://127.0.0.1:$N2_PORT/health"

mkdir -p "$DIR/gateway"
spawn gateway env AENV_HOME="$DIR/gateway" \
  "$AENV" gateway --host 127.0.0.1 --port "$GATEWAY_PORT" --cluster "$REDIS_URL"
wait_up gateway "$DIR/gateway.pid" curl -fsS "$GATEWAY_URL/health"
KEY=$(cat "$DIR/gateway/secrets/api-key")

export E2B_API_URL="$GATEWAY_URL" E2B_SANDBOX_URL="$GATEWAY_URL" E2B_API_KEY="$KEY"
export AENV_CLUSTER_DIR="$DIR"
demo() { .venv/bin/python scripts/cluster_demo.py --redis "$REDIS_URL" "$@"; }
demo spread                                   # creates on both, a fork, a pause on n1
echo "cluster: stopping n1 (SIGTERM: it drains, then stops)"
kill -TERM "$(cat "$DIR/n1.pid")"
for _ in $(seq 1 300); do running "$DIR/n1.pid" || break; sleep 0.2; done
demo resume                                   # n1 gone: the gateway resumes it on n2
echo "cluster: starting n1 again"
start_node n1 "$N1_PORT" 91
wait_up n1 "$DIR/n1.pid" curl -fsS "http://127.0.0.1:$N1_PORT/health"
demo finish                                   # both ready again; the demo's sandboxes killed

cat <<EOT

gateway       $GATEWAY_URL  (nodes: n1 http://127.0.0.1:$N1_PORT, n2 http://127.0.0.1:$N2_PORT)
API key       $KEY   (in $DIR/gateway/secrets/api-key)
Redis         $REDIS_URL
logs          $DIR/{redis,n1,n2,gateway}.log
stop it all   make cluster-stop    (or: scripts/cluster-stop.sh)

Point E2B code at it:
  export E2B_API_URL=$GATEWAY_URL E2B_SANDBOX_URL=$GATEWAY_URL E2B_API_KEY=$KEY
  curl -H "X-API-KEY: $KEY" $GATEWAY_URL/nodes
EOT
