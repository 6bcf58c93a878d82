"""The quickstart learns: `configs/quickstart.toml`, as shipped, through the real CLI in a subprocess (tiny Qwen3,
the lowercase environment, LoRA)."""

from helpers import REPO, jaxrl, read_metrics, subprocess_env

LIBTPU_LINES = ("Failed to find host bounds", "unexpected worker hostname", "libtpu")


def test_lowercase_is_learned(tmp_path, tiny_model_dir):
    """RL on a shipped environment that the tiny model can learn: the mean reward of the last steps is
    clearly above that of the first steps; the console has no line from libtpu probing for a TPU."""
    cfg = tmp_path / "learn.toml"
    cfg.write_text((REPO / "configs" / "quickstart.toml").read_text()
                   .replace('name = "quickstart"', 'name = "learn"')
                   .replace('model_path = "../assets/qwen3-tiny"', f'model_path = "{tiny_model_dir}"\n'
                            f'output_dir = "{tmp_path / "runs"}"'))
    # as a user's shell runs it: no JAX_PLATFORMS (the session sets cpu), libtpu installed (the test extra), and
    # no other process's libtpu lock in the way of its probe; jaxrl itself keeps libtpu from probing
    env = {k: v for k, v in subprocess_env().items() if k != "JAX_PLATFORMS"} | {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    out = jaxrl("run", str(cfg), timeout=900, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not [line for line in (out.stdout + out.stderr).splitlines() if any(s in line for s in LIBTPU_LINES)]
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "runs" / "learn")]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"reward/mean: first 3 steps {first:.3f}, last 3 steps {last:.3f}: {rewards}")
    assert last > first + 0.1
