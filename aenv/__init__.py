"""aenv: isolated microVM sandboxes for AI agents and RL rollouts, speaking the E2B API.

This module stays empty of imports on purpose: ``aenv.envd`` runs inside guests where only
its own dependencies are installed, and it imports this package.
"""

__version__ = "0.1.0"
