"""Entry point of the ``aenv`` command: one typer app, one sub-command module per area.

Each area registers itself in ``_register``; a module imports only what its commands need
so ``aenv --help`` stays fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="aenv: microVM sandboxes for AI agents and RL, speaking the E2B API.")


@app.callback()
def _main() -> None:
    """aenv: microVM sandboxes for agents and RL, speaking the E2B API."""


def _register() -> None:
    from . import doctor, gateway, images, sandbox, server, template

    doctor.register(app)
    gateway.register(app)
    images.register(app)
    sandbox.register(app)
    server.register(app)
    template.register(app)


_register()

if __name__ == "__main__":
    app()
