"""`make run`: start envd on the host and drive it with the real E2B Python SDK."""

print("demo: envd services are not implemented yet")
