#!/usr/bin/env bash
# `make run`: the main job on a fresh machine, with embedded defaults (SQLite, local
# snapshot store, one node). Builds the guest kernel and base image (once), starts
# `aenv server` in the background (or reuses a running one), drives it with the real E2B
# Python SDK, and says where everything is.
set -euo pipefail
cd "$(dirname "$0")/.."

export AENV_HOME=${AENV_HOME:-/var/lib/aenv}
PORT=${AENV_LISTEN_PORT:-3000}
URL="http://127.0.0.1:$PORT"
LOG_DIR="$AENV_HOME/logs"
LOG="$LOG_DIR/server.log"
PIDFILE="$AENV_HOME/server.pid"
AENV=.venv/bin/aenv
mkdir -p "$LOG_DIR"

"$AENV" image build          # the cloud kernel + base image; a cache hit after the first run

running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }
if running && curl -fsS -o /dev/null "$URL/health"; then
  echo "run: aenv server already running (pid $(cat "$PIDFILE"))"
else
  echo "run: starting aenv server on $URL (log: $LOG)"
  setsid nohup "$AENV" server --port "$PORT" >>"$LOG" 2>&1 < /dev/null &
  echo $! > "$PIDFILE"
  for _ in $(seq 1 600); do
    curl -fsS -o /dev/null "$URL/health" 2>/dev/null && break
    running || { echo "run: the server exited; last lines of $LOG:" >&2; tail -20 "$LOG" >&2; exit 1; }
    sleep 0.2
  done
fi

export E2B_API_URL="$URL" E2B_SANDBOX_URL="$URL"
export E2B_API_KEY=${AENV_API_KEY:-$(cat "$AENV_HOME/secrets/api-key")}
export AENV_URL="$URL" AENV_API_KEY="$E2B_API_KEY"
.venv/bin/python scripts/demo.py

cat <<EOT

aenv server   $URL (pid $(cat "$PIDFILE")); stop it with: kill \$(cat $PIDFILE)
server log    $LOG
API key       $AENV_HOME/secrets/api-key
data          $AENV_HOME (SQLite db, kernels, images, VM working dirs)

Point existing E2B code at it:
  export E2B_API_URL=$URL E2B_SANDBOX_URL=$URL E2B_API_KEY=\$(cat $AENV_HOME/secrets/api-key)
EOT
