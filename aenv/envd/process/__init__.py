"""The ``process.Process`` Connect service: start, stream, signal and feed processes.

Modules, each with one job: ``service`` (the RPCs), ``registry`` (live and recently exited
processes by pid and tag), ``handle`` (one process: readers, input, signals, end),
``launch`` (request -> command line, environment, credentials, spawn), ``pty``,
``fanout`` (output to attached streams, bounded), ``stream`` (event order), ``exit``
(end-event wording), ``errors``.
"""

from .service import ProcessService

__all__ = ["ProcessService"]
