"""What goes into a guest: the init, envd's supervision, boot arguments, the ``base`` recipe.

Boot of a guest, as seen on its serial console (``console=ttyS0``)::

    [kernel]  ...                                  the kernel's own log (quiet by default)
    aenv-initrd: start 1.23                        cloud kernel only: initramfs /init runs
    aenv-initrd: modules-loaded 1.40               virtio modules inserted
    aenv-initrd: switch-root 1.45                  root disk mounted, handing over
    aenv-init: start 1.47                          the image's /sbin/aenv-init (PID 1) runs
    aenv-init: mounted 1.50                        proc, sys, dev, devpts, shm, run, cgroup2
    aenv-init: network 1.56                        lo, eth0, hostname, resolv.conf done
    aenv-init: envd-exec 1.58                      envd's launcher starts (python3)
    aenv-init: envd-imported 3.90                  envd and its dependencies imported
    aenv-init: envd-fork 3.92 pid=231              the server is forked (again on restart)
    aenv-init: envd-exit 9.87 rc=-9                the server exited (-N: killed by signal N)
    aenv-init: launcher-exit 9.99 rc=1             the launcher itself exited (restarted)

Each marker is one line ``<prefix>: <phase> <uptime> [key=value ...]`` where uptime is the
guest's ``/proc/uptime`` in seconds. ``markers.parse`` turns console text into phase times;
envd itself is ready when ``GET /health`` answers (the host polls for that).
"""
