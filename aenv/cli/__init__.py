"""The ``aenv`` command."""
