#!/bin/sh
# /init of the cloud kernel's initramfs (busybox). Loads the modules listed in
# /etc/aenv-modules (already in dependency order), mounts the root disk named by root=
# (default /dev/vda) read-write, moves /dev over and switch_roots to init= (default
# /sbin/aenv-init), passing on its arguments. Prints "aenv-initrd: <phase> <uptime>" markers on the console.
export PATH=/bin
mount -t proc proc /proc
mount -t devtmpfs devtmpfs /dev
mark() { read -r up _ </proc/uptime; echo "aenv-initrd: $1 $up"; }
mark start

root=/dev/vda fstype=ext4 flags=rw init=/sbin/aenv-init
read -r cmdline </proc/cmdline
for arg in $cmdline; do
  case "$arg" in
    root=*) root=${arg#root=} ;;
    rootfstype=*) fstype=${arg#rootfstype=} ;;
    init=*) init=${arg#init=} ;;
    ro) flags=ro ;;
    rw) flags=rw ;;
  esac
done

while read -r mod; do
  insmod "/lib/modules/$mod.ko" || echo "aenv-initrd: insmod $mod failed"
done </etc/aenv-modules
mark modules-loaded

i=0
while [ ! -b "$root" ]; do
  i=$((i + 1))
  if [ "$i" -gt 300 ]; then
    echo "aenv-initrd: $root did not appear; root disk must be the first virtio-blk drive"
    exec sh
  fi
  usleep 10000
done
if ! mount -t "$fstype" -o "$flags" "$root" /newroot; then
  echo "aenv-initrd: cannot mount $root"
  exec sh
fi
mark switch-root
mount --move /dev /newroot/dev
umount /proc
exec switch_root /newroot "$init" "$@"
