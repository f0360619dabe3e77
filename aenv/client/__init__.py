"""Host-side clients: ``envd`` speaks to a sandbox's daemon (Connect JSON over HTTP), ``api``
to an aenv server's REST API. The orchestrator, template builds and the CLI share them."""
