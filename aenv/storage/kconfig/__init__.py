"""Kernel config fragments (package data): ``small.txt`` is merged over ``tinyconfig``."""
