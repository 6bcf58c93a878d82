"""The example buffer: hand-checked cases and hypothesis properties of its invariants."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.config.envs import BufferConfig
from jaxrl.rl.buffer import Buffer, BufferExhausted, BufferState, has_signal

FILTER = {"online_difficulty_filtering": True}
sizes_st = st.lists(st.integers(1, 12), min_size=1, max_size=4)
reward_st = st.sampled_from([0.0, 0.25, 0.5, 1.0])


def roundtrip(state: BufferState) -> BufferState:
    return BufferState.from_json(json.loads(json.dumps(state.to_json())))


def play(buf: Buffer, state: BufferState, steps: int, groups: int, rewards) -> tuple[list, BufferState]:
    """`steps` steps of `groups` groups; group g of a step gets rewards `rewards(env, example)`."""
    jobs_seen = []
    for _ in range(steps):
        jobs, state = buf.draw(state, groups)
        _, state = buf.record(state, jobs, [rewards(env, ex) for env, ex in jobs])
        jobs_seen += jobs
    return jobs_seen, state


def test_single_env_visits_each_example_once_per_epoch():
    buf = Buffer((5,), BufferConfig(seed=3))
    jobs, state = buf.draw(BufferState.fresh(1), 10)
    examples = [e for _, e in jobs]
    assert sorted(examples[:5]) == sorted(examples[5:]) == [0, 1, 2, 3, 4]
    assert examples == buf.order(0, 0).tolist() + buf.order(0, 1).tolist()
    assert state.drawn == (10,) and state.chosen == (10,)


def test_env_ratios_weighted_round_robin_by_hand():
    buf = Buffer((4, 4), BufferConfig(env_ratios=[1.0, 3.0]))
    jobs, _ = buf.draw(BufferState.fresh(2), 8)
    # t=0: .25 vs .75 -> 1; t=1: .5 vs .5 (tie) -> 0; t=2: -.25 vs 1.25 -> 1; t=3: 0 vs 1 -> 1; repeats
    assert [env for env, _ in jobs] == [1, 0, 1, 1, 1, 0, 1, 1]
    equal, _ = Buffer((4, 4, 4), BufferConfig()).draw(BufferState.fresh(3), 6)
    assert [env for env, _ in equal] == [0, 1, 2, 0, 1, 2]  # no env_ratios: round robin


def test_difficulty_classification_and_filtering_by_hand():
    buf = Buffer((4,), BufferConfig(**FILTER, easy_threshold=0.8, hard_threshold=0.2))
    assert [buf.classify(m) for m in (0.8, 0.79, 0.2, 0.21, 1.0, 0.0)] == [
        "easy", "normal", "hard", "normal", "easy", "hard"]
    jobs = [(0, 0), (0, 1), (0, 2), (0, 3)]
    keep, state = buf.record(BufferState.fresh(1), jobs, [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], []])
    assert keep == [False, True, False, False]
    assert state.mean_reward == ({0: 1.0, 1: 0.5, 2: 0.0},)  # a group with no successful rollout: nothing
    assert buf.retired(state, 0) == {0, 2}  # easy_fraction = hard_fraction = 0: both retired
    assert buf.metrics(state, keep) == {"buffer/filtered_groups": 3.0, "buffer/easy": 1.0, "buffer/hard": 1.0,
                                        "buffer/retired": 2.0}
    drawn, _ = buf.draw(state, 6)
    assert {e for _, e in drawn} == {1, 3}


def test_without_filtering_nothing_is_dropped_or_recorded():
    buf = Buffer((3,), BufferConfig(easy_threshold=0.5))
    state = BufferState.fresh(1)
    keep, after = buf.record(state, [(0, 0), (0, 1)], [[1.0, 1.0], [0.0]])
    assert keep == [True, True] and after == state and buf.metrics(after, keep) == {}


def test_all_retired_raises_a_clear_error():
    buf = Buffer((2,), BufferConfig(**FILTER))
    _, state = buf.record(BufferState.fresh(1), [(0, 0), (0, 1)], [[1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(BufferExhausted, match="every example is retired as easy or hard"):
        buf.draw(state, 1)


def test_bad_sizes_and_ratios():
    with pytest.raises(ValueError, match="at least one example"):
        Buffer((3, 0), BufferConfig())
    with pytest.raises(ValueError, match="env_ratios has 3 entries for 2"):
        Buffer((3, 3), BufferConfig(env_ratios=[1.0, 1.0, 1.0]))


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, seed=st.integers(0, 2**31 - 1), cuts=st.lists(st.integers(0, 9), max_size=4),
       filtering=st.booleans(), data=st.data())
def test_draws_depend_only_on_seed_and_state(sizes, seed, cuts, filtering, data):
    """Drawing in pieces, with the state saved to JSON and read back in between (a resume), gives the
    draws of one uninterrupted run."""
    table = data.draw(st.dictionaries(st.tuples(st.integers(0, 3), st.integers(0, 11)),
                                      st.lists(reward_st, max_size=3)))
    cfg = BufferConfig(seed=seed, online_difficulty_filtering=filtering, easy_fraction=0.5, hard_fraction=0.5)
    buf = Buffer(tuple(sizes), cfg)

    def rewards(env, ex):
        return table.get((env, ex), [0.5, 0.25])

    whole, end = [], BufferState.fresh(len(sizes))
    pieces, resumed = [], BufferState.fresh(len(sizes))
    try:
        for n in cuts:
            jobs, end = play(buf, end, 1, n, rewards)
            whole += jobs
    except BufferExhausted:
        return
    for n in cuts:
        jobs, resumed = play(Buffer(tuple(sizes), cfg), roundtrip(resumed), 1, n, rewards)
        pieces += jobs
    assert pieces == whole and resumed == end


@settings(max_examples=60, deadline=None)
@given(ratios=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=4).filter(lambda r: sum(r) > 0.1),
       n=st.integers(1, 200))
def test_env_ratios_are_kept_within_one_group(ratios, n):
    buf = Buffer((7,) * len(ratios), BufferConfig(env_ratios=ratios))
    jobs, state = buf.draw(BufferState.fresh(len(ratios)), n)
    for i, w in enumerate(ratios):
        count = sum(1 for env, _ in jobs if env == i)
        assert count == state.chosen[i]
        assert abs(count - w / sum(ratios) * n) < 1 + 1e-9
        if w == 0:
            assert count == 0


@given(st.lists(reward_st, max_size=6))
def test_filtered_groups_are_exactly_those_with_equal_rewards(rewards):
    buf = Buffer((1,), BufferConfig(**FILTER))
    keep, _ = buf.record(BufferState.fresh(1), [(0, 0)], [rewards])
    assert keep == [has_signal(rewards)]
    assert keep[0] == (len(set(rewards)) > 1)


@settings(max_examples=80, deadline=None)
@given(size=st.integers(1, 30), easy_fraction=st.floats(0, 1), hard_fraction=st.floats(0, 1),
       means=st.lists(st.floats(0, 1), max_size=30), draws=st.integers(1, 40))
def test_kept_share_of_easy_and_hard_examples_is_bounded(size, easy_fraction, hard_fraction, means, draws):
    cfg = BufferConfig(**FILTER, easy_fraction=easy_fraction, hard_fraction=hard_fraction)
    buf = Buffer((size,), cfg)
    state = BufferState(drawn=(0,), chosen=(0,), mean_reward=({i: m for i, m in enumerate(means[:size])},))
    retired = buf.retired(state, 0)
    for kind, fraction in (("easy", easy_fraction), ("hard", hard_fraction)):
        pool = {e for e, m in state.mean_reward[0].items() if buf.classify(m) == kind}
        assert len(pool - retired) == math.floor(fraction * len(pool))
    try:
        jobs, _ = buf.draw(state, draws)
    except BufferExhausted:
        assert len(retired) == size
        return
    assert not {e for _, e in jobs} & retired


@given(sizes=sizes_st, data=st.data())
def test_state_json_round_trip(sizes, data):
    n = len(sizes)
    state = BufferState(
        drawn=tuple(data.draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))),
        chosen=tuple(data.draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))),
        mean_reward=tuple(data.draw(st.dictionaries(st.integers(0, 10**5), st.floats(-1e3, 1e3))) for _ in sizes))
    assert roundtrip(state) == state
