"""Where arrays live: the weight declaration (`ParamSpec`), the device mesh and its logical-axis rules,
and the multi-host runtime (`jax.distributed`, host-local data to global arrays).

May import: `jaxrl.config`.
"""
