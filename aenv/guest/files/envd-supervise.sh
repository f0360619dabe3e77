#!/bin/sh
# envd under supervision, as the child of tini (which reaps orphans as PID 1). The launcher
# (/opt/aenv/bin/envd) imports envd once and re-forks the server itself whenever it dies;
# this loop restarts the launcher 0.2 s after it exits, should that ever happen. Prints
# "aenv-init: envd-exec <uptime>" before each launch and
# "aenv-init: launcher-exit <uptime> rc=<code>" after each exit.
mark() { read -r up _ </proc/uptime; echo "aenv-init: $1 $up${2:+ $2}"; }
cd /
while :; do
  mark envd-exec
  /usr/bin/python3 -S /opt/aenv/bin/envd --guest --default-user user --port 49983 </dev/null
  mark launcher-exit "rc=$?"
  sleep 0.2
done
