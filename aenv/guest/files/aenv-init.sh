#!/bin/sh
# aenv guest init: PID 1 until it execs tini. Mounts the API filesystems (one `mount -a` over
# /usr/lib/aenv/fstab; what the initramfs already mounted is skipped), configures lo and
# eth0, the hostname and /etc/resolv.conf from the kernel's ip= parameter, then execs tini
# (which reaps orphans as PID 1) running envd-supervise. Every external command costs tens
# of milliseconds under emulation, so the path to envd runs as few as possible: the /dev
# links and the interface are left alone when the initramfs (or the kernel) already made
# them, and otherwise the links are made in the background. Markers
# "aenv-init: <phase> <uptime>" go to the console; see aenv/guest/markers.py.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8
unset TERM

[ -e /proc/self ] || mount -t proc -o nosuid,nodev,noexec proc /proc
mark() { read -r up _ </proc/uptime; echo "aenv-init: $1 $up"; }
mark start
mount -a -T /usr/lib/aenv/fstab || echo "aenv-init: some mounts failed"
mark mounted
(
  if [ ! -e /dev/fd ]; then
    ln -sfn /proc/self/fd /dev/fd
    ln -sf /proc/self/fd/0 /dev/stdin
    ln -sf /proc/self/fd/1 /dev/stdout
    ln -sf /proc/self/fd/2 /dev/stderr
  fi
  mkdir -p /run/lock /run/user
) &

# True when $1 already has a default route (read with builtins: no ip process).
routed() {
  while read -r iface dest _; do
    [ "$iface" = "$1" ] && [ "$dest" = 00000000 ] && return 0
  done </proc/net/route
  return 1
}

# ip=<client>::<gateway>:<netmask>:<hostname>:<device>:off:<dns0>[:<dns1>]
# (the kernel's own syntax, so a kernel with CONFIG_IP_PNP agrees with this script).
hostname=sandbox
ipconf=
read -r cmdline </proc/cmdline
for arg in $cmdline; do
  case "$arg" in ip=*) ipconf=${arg#ip=} ;; esac
done
if [ -n "$ipconf" ]; then
  IFS=: read -r addr _ gw mask name dev _ dns0 dns1 _ <<IPCONF
$ipconf
IPCONF
  [ -n "$name" ] && hostname=$name
  dev=${dev:-eth0}
  routed "$dev" || ip -force -batch - <<NET || echo "aenv-init: network setup failed"
link set lo up
link set $dev up
addr replace $addr/$mask dev $dev
route replace default via $gw dev $dev
NET
  : >/etc/resolv.conf
  for ns in $dns0 $dns1; do echo "nameserver $ns" >>/etc/resolv.conf; done
else
  ip link set lo up
fi
echo "$hostname" >/proc/sys/kernel/hostname
echo "$hostname" >/etc/hostname
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t%s\n' \
  "$hostname" >/etc/hosts
mark network

ulimit -n 1048576 2>/dev/null || ulimit -n 65536
exec /usr/bin/tini -- /bin/sh /usr/lib/aenv/envd-supervise
