"""Where arrays live: a weight's description (`ParamSpec`, read from its declaration in
`jaxrl.model.modules`), the device mesh and its logical-axis rules,
and the multi-host runtime (`jax.distributed`, host-local data to global arrays).

May import: `jaxrl.config`.
"""
