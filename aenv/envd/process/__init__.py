"""The ``process.Process`` Connect service: start, stream, signal and feed processes."""
