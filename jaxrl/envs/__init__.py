"""verifiers environments: loading an `[[env]]` (v1 tasksets and classic `load_environment` modules) and
playing rollout groups through them against the run's rollout server.

May import: `jaxrl.config`, `jaxrl.parallel`, `jaxrl.model`, `jaxrl.inference`.
"""
