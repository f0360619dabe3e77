"""The in-guest code-interpreter server on port 49999 (what ``e2b-code-interpreter`` talks to).

``POST /execute`` runs code in a Jupyter kernel (through jupyter_client) and streams the
newline-delimited JSON the SDKs parse; ``/contexts`` creates, lists, restarts and removes
kernels; ``GET /health`` answers 200 once the server is up. Like envd it runs inside the guest
and imports nothing from the host side of aenv: ``python -m aenv.interpreter``.
"""

JUPYTER_PORT = 49999
