"""The ``filesystem.Filesystem`` Connect service: stat, list, move, remove and watch.

``service`` is the RPC surface; ``entry`` builds EntryInfo, ``listing`` walks directories,
``dirs`` creates them for a user, ``metadata`` keeps ``user.e2b.*`` xattrs, ``watcher`` and
``inotify`` watch trees, ``mounts`` spots network filesystems, ``errors`` names failures.
"""
