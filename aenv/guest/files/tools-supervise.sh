#!/.aenv/bin/sh
# envd from the tools drive under supervision, as the child of tini (PID 1). The tools'
# Python runs through the tools' own loader and libraries (--library-path: no
# LD_LIBRARY_PATH in anyone's environment; --inhibit-cache: the image's ld.so.cache is
# never read) in isolated mode without site (-I -S: no PYTHON* variables, no
# site-packages; its prefix is /.aenv, found from its own path) and the C locale
# (LC_ALL=C: glibc loads no locale or gconv file of the image, which belong to the image's
# libc; Python runs in UTF-8 mode under it). envd switches users with
# the tools' setpriv (AENV_ENVD_SETPRIV), not whatever the image's is. The launcher
# re-forks the server itself; this loop restarts the launcher 0.2 s after it exits. Same
# markers as the base image's envd-supervise.
T=/.aenv
mark() { read -r up _ </proc/uptime; echo "aenv-init: $1 $up${2:+ $2}"; }
export AENV_ENVD_SETPRIV="$T/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path $T/lib $T/bin/setpriv"
cd /
while :; do
  mark envd-exec
  LC_ALL=C $T/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path $T/lib $T/bin/python3.11 -I -S \
    $T/bin/envd --guest --default-user user --port 49983 </dev/null
  mark launcher-exit "rc=$?"
  $T/bin/sleep 0.2
done
