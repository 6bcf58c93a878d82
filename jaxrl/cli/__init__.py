"""The `jaxrl` command line (typer) and the local run management behind it (list, logs, stop, delete,
checkpoints, plot). The validate/init path imports no JAX.

May import: every other subpackage (lazily, inside commands, beyond `jaxrl.config`).
"""
