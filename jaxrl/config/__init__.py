"""The run configuration: the Hosted Training TOML schema plus the `[jax]` table, validated with pydantic.

Owns: the typed config models, the `file: key: reason` errors, .env files and the starter TOML.
May import: the standard library, pydantic and tomllib only (no JAX: `jaxrl validate` and `jaxrl init`
stay fast and run where JAX is not installed).
"""
