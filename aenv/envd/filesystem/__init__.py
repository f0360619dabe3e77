"""The ``filesystem.Filesystem`` Connect service: stat, list, move, remove and watch."""
