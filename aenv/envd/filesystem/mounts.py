"""Is a path on a network filesystem? (NFS, CIFS/SMB, FUSE)

Watching such a path is refused unless the caller allows it: inotify sees only local
changes there. Like upstream envd this asks ``statfs(2)`` for the filesystem's magic
number rather than parsing the mount table.
"""

from __future__ import annotations

import ctypes
import os

# include/uapi/linux/magic.h (+ the CIFS/SMB2 magics from fs/smb)
NETWORK_MAGICS = frozenset({
    0x6969,  # NFS_SUPER_MAGIC
    0xFF534D42,  # CIFS_MAGIC_NUMBER
    0x517B,  # SMB_SUPER_MAGIC
    0xFE534D42,  # SMB2_MAGIC_NUMBER
    0x65735546,  # FUSE_SUPER_MAGIC
})

_libc = ctypes.CDLL(None, use_errno=True)
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
# struct statfs starts with f_type (__fsword_t, a C long on every 64-bit Linux ABI);
# 128 bytes covers the whole struct on x86_64 and aarch64.
_STATFS_SIZE = 128


def filesystem_magic(path: str) -> int:
    """``f_type`` of the filesystem holding ``path``. Raises OSError."""
    buf = ctypes.create_string_buffer(_STATFS_SIZE)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def is_network_mount(path: str) -> bool:
    return filesystem_magic(path) in NETWORK_MAGICS
