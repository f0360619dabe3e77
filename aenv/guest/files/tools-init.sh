#!/.aenv/bin/sh
# aenv guest init for images without a guest layer of their own: PID 1 until it execs tini,
# run by the tools drive's static busybox (the image may have no shell, no libc, no
# mount). The cloud initramfs mounted the tools drive read-only at /.aenv and switch_rooted
# here. Mounts the API filesystems (each mountpoint made when the image lacks it; what the
# initramfs mounted is skipped), configures lo and eth0 (when the initramfs did not), the
# hostname, /etc/hosts and /etc/resolv.conf from the kernel's ip= parameter, then execs the
# tools' tini running envd-supervise. The image's own PATH is what envd and everything it
# starts get; the tools are called by their paths. Same markers as /sbin/aenv-init
# ("aenv-init: <phase> <uptime>", aenv/guest/markers.py).
T=/.aenv
unset TERM
[ -e /proc/self ] || { $T/bin/mkdir -p /proc; $T/bin/mount -t proc -o nosuid,nodev,noexec proc /proc; }
mark() { read -r up _ </proc/uptime; echo "aenv-init: $1 $up"; }
mark start

mounted=" "
while read -r _ point _; do mounted="$mounted$point "; done </proc/mounts
# fstype mountpoint options
api() {
  case "$mounted" in *" $2 "*) return 0 ;; esac
  [ -d "$2" ] || $T/bin/mkdir -p "$2"
  $T/bin/mount -t "$1" -o "$3" "$1" "$2" || echo "aenv-init: mounting $2 failed"
}
api sysfs /sys nosuid,nodev,noexec
api devtmpfs /dev nosuid,mode=0755
api devpts /dev/pts nosuid,noexec,gid=5,mode=0620,ptmxmode=0666
api tmpfs /dev/shm nosuid,nodev,mode=1777
api tmpfs /run nosuid,nodev,mode=0755,size=20%
api cgroup2 /sys/fs/cgroup nosuid,nodev,noexec,nsdelegate
mark mounted
if [ ! -e /dev/fd ]; then
  $T/bin/ln -sfn /proc/self/fd /dev/fd
  $T/bin/ln -sf /proc/self/fd/0 /dev/stdin
  $T/bin/ln -sf /proc/self/fd/1 /dev/stdout
  $T/bin/ln -sf /proc/self/fd/2 /dev/stderr
fi

routed() {
  while read -r iface dest _; do
    [ "$iface" = "$1" ] && [ "$dest" = 00000000 ] && return 0
  done </proc/net/route
  return 1
}

# ip=<client>::<gateway>:<netmask>:<hostname>:<device>:off:<dns0>[:<dns1>]
hostname=sandbox
ipconf=
read -r cmdline </proc/cmdline
for arg in $cmdline; do
  case "$arg" in ip=*) ipconf=${arg#ip=} ;; esac
done
[ -d /etc ] || $T/bin/mkdir -p /etc
if [ -n "$ipconf" ]; then
  IFS=: read -r addr _ gw mask name dev _ dns0 dns1 _ <<IPCONF
$ipconf
IPCONF
  [ -n "$name" ] && hostname=$name
  dev=${dev:-eth0}
  if ! routed "$dev"; then
    { $T/bin/ip link set lo up && $T/bin/ip link set "$dev" up &&
      $T/bin/ip addr add "$addr/$mask" dev "$dev" &&
      $T/bin/ip route add default via "$gw" dev "$dev"; } || echo "aenv-init: network setup failed"
  fi
  { : >/etc/resolv.conf
    for ns in $dns0 $dns1; do echo "nameserver $ns" >>/etc/resolv.conf; done
  } 2>/dev/null || echo "aenv-init: cannot write /etc/resolv.conf"
else
  $T/bin/ip link set lo up
fi
echo "$hostname" >/proc/sys/kernel/hostname
echo "$hostname" 2>/dev/null >/etc/hostname
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t%s\n' \
  "$hostname" 2>/dev/null >/etc/hosts
mark network

ulimit -n 1048576 2>/dev/null || ulimit -n 65536
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
exec $T/bin/tini -- $T/bin/sh $T/bin/envd-supervise
