"""Storage: guest kernels, root-filesystem images, per-sandbox disks, snapshot files.

Images and kernels are built once and then only read; everything they are made from is
downloaded into ``Settings.cache_dir`` and never installed on the host.
"""
