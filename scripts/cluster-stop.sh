#!/usr/bin/env bash
# `make cluster-stop`: stop what `make cluster` started, from its pid files: the gateway,
# the nodes' sandboxes (killed through each node's API), the nodes (SIGTERM; a node with
# nothing running stops at once; SIGKILL after 60 s), then Redis. Then aenv's own sweep
# removes any namespace, nft table or VMM left under the nodes' prefixes. Homes, logs and
# the shared store stay in AENV_CLUSTER_DIR (rm -rf it to start afresh).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/cluster-env.sh

alive() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }
stop() {  # NAME SIGNAL-WAIT-SECONDS
  local name=$1 wait=$2 pid
  alive "$name" || { rm -f "$DIR/$name.pid"; return 0; }
  pid=$(cat "$DIR/$name.pid")
  echo "cluster-stop: stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 $((wait * 5))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "cluster-stop: $name still running after ${wait} s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$DIR/$name.pid"
}
kill_sandboxes() {  # ID PORT
  local key ids
  key=$(cat "$DIR/$1/secrets/api-key" 2>/dev/null) || return 0
  ids=$(curl -fsS -H "X-API-KEY: $key" "http://127.0.0.1:$2/v2/sandboxes?state=running,paused&limit=100" 2>/dev/null \
        | .venv/bin/python -c 'import json,sys; print(" ".join(s["sandboxID"] for s in json.load(sys.stdin)))' 2>/dev/null) || return 0
  for id in $ids; do
    curl -fsS -o /dev/null -X DELETE -H "X-API-KEY: $key" "http://127.0.0.1:$2/sandboxes/$id" || true
  done
}

stop gateway 15
alive n1 && kill_sandboxes n1 "$N1_PORT"
alive n2 && kill_sandboxes n2 "$N2_PORT"
for node in $NODES; do stop "$node" 60; done
stop redis 10
for node in $NODES; do
  [ -d "$DIR/$node" ] || continue
  AENV_HOME="$DIR/$node" AENV_NAME_PREFIX="aenv$node" .venv/bin/python - <<'PY' || true
from aenv.config import Settings
from aenv.network import cleanup_leftovers
cleanup_leftovers(Settings.from_env())
PY
done
echo "cluster-stop: stopped; state kept in $DIR"
