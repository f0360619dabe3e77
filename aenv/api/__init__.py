"""The E2B-compatible REST API and aenv's extensions, served by ``aenv server``.

Routes translate HTTP into orchestrator calls and records into E2B's JSON shapes; they never
start processes or touch the host.
"""
