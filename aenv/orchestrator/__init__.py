"""Sandbox lifecycle on one node: create, TTL, pause/resume, snapshot, fork, kill, recovery.

The orchestrator decides; ``aenv/runtime``, ``aenv/network`` and ``aenv/storage`` act; the
store remembers. It never speaks a VMM protocol itself.
"""
