"""What goes into a guest: the init, envd's supervision, boot arguments, the ``base`` recipe.

Boot of a guest, as seen on its serial console (``console=ttyS0``)::

    [kernel]  ...                                  the kernel's own log (quiet by default)
    aenv-initrd: start 1.23                        cloud kernel only: initramfs /init runs
    aenv-initrd: modules-loaded 1.40               virtio modules inserted
    aenv-initrd: network 1.44                      lo, eth0 and the /dev links (busybox)
    aenv-initrd: switch-root 1.45                  root disk mounted, handing over
    aenv-init: start 1.47                          the image's /sbin/aenv-init (PID 1) runs
    aenv-init: mounted 1.50                        proc, sys, dev, devpts, shm, run, cgroup2
    aenv-init: network 1.56                        hostname, resolv.conf (and eth0 if not up)
    aenv-init: envd-exec 1.58                      envd's launcher starts (python3)
    aenv-init: envd-imported 3.90                  envd and its dependencies imported
    aenv-init: envd-fork 3.92 pid=231              the server is forked (again on restart)
    aenv-init: envd-exit 9.87 rc=-9                the server exited (-N: killed by signal N)
    aenv-init: launcher-exit 9.99 rc=1             the launcher itself exited (restarted)

Each marker is one line ``<prefix>: <phase> <uptime> [key=value ...]`` where uptime is the
guest's ``/proc/uptime`` in seconds. ``markers.parse`` turns console text into phase times;
envd itself is ready when ``GET /health`` answers (the host polls for that). For a boot
benchmark: kernel = up to the first ``start`` marker, init = ``aenv-init: start`` to
``envd-exec``, envd = ``envd-exec`` to the first ``/health`` answer.

Why this init (measured under TCG on a 2-core host, guest uptime, noisy): every exec of a
dynamically linked binary costs 30-40 ms and a ``python3 -S`` start 80 ms warm, 400+ ms
cold, while the shell's builtins are free. So PID 1 is a POSIX shell script that runs only
three external commands before envd (``mount -a``, ``ip -batch``, ``tini``): about 0.3-0.4 s
from ``aenv-init: start`` to ``envd-exec``. With the cloud kernel the initramfs's static
busybox has already brought up eth0 and made the /dev links (about 50 ms), so aenv-init
skips ``ip`` and ``ln`` there: 0.2 s from ``start`` to ``envd-exec``. A Python PID 1 would
add a second interpreter start. tini (Debian's) reaps orphans as PID 1. Importing envd
dominates the boot (about 1.8 s with a warm page cache, 3-4 s cold), so the launcher imports
it once and forks the server; a killed server is back in well under a second instead of
paying the import again. Prefetching envd's files in the background was tried and made the
import slower on one vCPU (the reads compete with it), so it is not done.
"""
