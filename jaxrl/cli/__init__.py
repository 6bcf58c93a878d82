"""The `jaxrl` command line (typer) and the local run management behind it (list, logs, stop, delete,
checkpoints, plot). The validate/init path imports no JAX.

May import: every other subpackage; JAX, and any other library slow to import or optional, only inside the
command that needs it (`main.py` imports every command module; `tests/test_structure.py` checks both).
"""
