"""Files copied verbatim into guests (a package only so that they ship as package data).

- ``initramfs-init.sh``: ``/init`` of the cloud kernel's initramfs.
- ``aenv-init.sh``: ``/sbin/aenv-init``, the image's init.
- ``fstab.txt``: ``/usr/lib/aenv/fstab``, the API filesystems aenv-init mounts.
- ``envd-supervise.sh``: ``/usr/lib/aenv/envd-supervise``, envd's restart loop under tini.
"""
