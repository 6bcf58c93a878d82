"""follow-rules: a multi-turn verifiers v1 taskset with generated data (no dataset download)."""

from follow_rules.taskset import FollowRulesEnv, FollowRulesTaskset

__all__ = ["FollowRulesEnv", "FollowRulesTaskset"]
