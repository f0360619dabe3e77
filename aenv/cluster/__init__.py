"""Many nodes behind one URL (issue 18): Redis holds the shared routing state, each node's
own store stays the truth for its sandboxes.

- ``registry``: the Redis key layout and its operations (node records, heartbeats, the
  sandbox -> node index); nothing else talks to Redis.
- ``node_agent``: the node's side: heartbeat, (re)publishing its index from its store.
- ``scheduling``: which node a create goes to.
- ``trust``: the cluster secret that gateway -> node calls carry.
- ``gateway``: ``aenv gateway``'s ASGI app (REST + data plane on one listener).
- ``handover``: paused sandboxes offered through the shared store (``AENV_SHARED_STORE``,
  ``aenv.storage.shared_store``) and claimed by the node that resumes them.
"""
