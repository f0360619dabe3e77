"""Many nodes behind one URL (issue 18): Redis holds the shared routing state, each node's
own store stays the truth for its sandboxes.

- ``registry``: the Redis key layout and its operations (node records, heartbeats, the
  sandbox -> node index, the volume -> node index); nothing else talks to Redis but
  ``shared_secrets``, the cluster's secrets (sealed under a key derived from the cluster
  secret), whose keys are its own.
- ``node_agent``: the node's side: heartbeat, (re)publishing its index from its store.
- ``scheduling``: which node a create goes to.
- ``trust``: the cluster secret that gateway -> node calls carry.
- ``gateway``: ``aenv gateway``'s ASGI app (REST + data plane on one listener);
  ``volume_routes``: its volume calls, sent to the node that holds the volume.
- ``handover``: paused sandboxes offered through the shared store (``AENV_SHARED_STORE``,
  ``aenv.storage.shared_store``) and claimed by the node that resumes them.
"""
