#!/bin/sh
# /init of the cloud kernel's initramfs (busybox). Loads the modules listed in
# /etc/aenv-modules (already in dependency order), brings up lo and the ip= interface as a
# kernel with CONFIG_IP_PNP would, adds the /dev links a userland expects, mounts the root
# disk named by root= (default /dev/vda) read-write, moves /dev over and switch_roots to
# init= (default /sbin/aenv-init), passing on its arguments. With aenv.tools=<device> (the
# tools drive, aenv/guest/tools.py) it also mounts that device read-only at /.aenv in the
# root (made when missing) when init= names a file there, or when the root has no init=
# of its own (a disk booted without knowing its image), and then switch_roots to
# /.aenv/bin/aenv-init; /dev is made in a root that lacks it. Busybox is static, so these
# commands cost a fraction of what the image's dynamically linked ip and ln cost under
# emulation; aenv-init skips what is already done. Prints "aenv-initrd: <phase> <uptime>"
# markers on the console.
export PATH=/bin
mount -t proc proc /proc
mount -t devtmpfs devtmpfs /dev
mark() { read -r up _ </proc/uptime; echo "aenv-initrd: $1 $up"; }
mark start
ln -sfn /proc/self/fd /dev/fd
ln -sf /proc/self/fd/0 /dev/stdin
ln -sf /proc/self/fd/1 /dev/stdout
ln -sf /proc/self/fd/2 /dev/stderr

root=/dev/vda fstype=ext4 flags=rw init=/sbin/aenv-init ipconf= tools=
read -r cmdline </proc/cmdline
for arg in $cmdline; do
  case "$arg" in
    root=*) root=${arg#root=} ;;
    rootfstype=*) fstype=${arg#rootfstype=} ;;
    init=*) init=${arg#init=} ;;
    ip=*) ipconf=${arg#ip=} ;;
    aenv.tools=*) tools=${arg#aenv.tools=} ;;
    ro) flags=ro ;;
    rw) flags=rw ;;
  esac
done

while read -r mod; do
  insmod "/lib/modules/$mod.ko" || echo "aenv-initrd: insmod $mod failed"
done </etc/aenv-modules
mark modules-loaded

# ip=<client>::<gateway>:<netmask>:<hostname>:<device>:... (see aenv-init for the rest).
ip link set lo up
if [ -n "$ipconf" ]; then
  IFS=: read -r addr _ gw mask _ dev _ <<IPCONF
$ipconf
IPCONF
  dev=${dev:-eth0}
  { ip link set "$dev" up && ip addr add "$addr/$mask" dev "$dev" &&
    ip route add default via "$gw" dev "$dev"; } || echo "aenv-initrd: network setup failed"
fi
mark network

# $1: a block device; waits up to 3 s for it to appear.
appeared() {
  i=0
  while [ ! -b "$1" ]; do
    i=$((i + 1))
    [ "$i" -gt 300 ] && return 1
    usleep 10000
  done
}
if ! appeared "$root"; then
  echo "aenv-initrd: $root did not appear; root disk must be the first virtio-blk drive"
  exec sh
fi
if ! mount -t "$fstype" -o "$flags" "$root" /newroot; then
  echo "aenv-initrd: cannot mount $root"
  exec sh
fi
if [ -n "$tools" ]; then
  case "$init" in
    /.aenv/*) ;;
    *) [ -e "/newroot$init" ] || init=/.aenv/bin/aenv-init ;;
  esac
  case "$init" in
    /.aenv/*)
      [ -d /newroot/.aenv ] || mkdir /newroot/.aenv
      if ! appeared "$tools" || ! mount -t ext4 -o ro "$tools" /newroot/.aenv; then
        echo "aenv-initrd: cannot mount the tools drive $tools"
        exec sh
      fi ;;
  esac
fi
[ -d /newroot/dev ] || mkdir /newroot/dev
mark switch-root
mount --move /dev /newroot/dev
umount /proc
exec switch_root /newroot "$init" "$@"
