"""Reinforcement learning: advantages and policy losses (pure functions), the example buffer, the rollout
producer (async levels, oversampling), a step's rollouts and their metrics, and the jitted train step.

May import: everything below it (`config`, `parallel`, `model`, `inference`, `envs`).
"""
