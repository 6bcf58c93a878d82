"""The quickstart learns: `configs/quickstart.toml`, as shipped, through the real CLI in a subprocess (tiny Qwen3,
the lowercase environment, LoRA)."""

from helpers import REPO, jaxrl, read_metrics


def test_lowercase_is_learned(tmp_path, tiny_model_dir):
    """RL on a shipped environment that the tiny model can learn: the mean reward of the last steps is
    clearly above that of the first steps."""
    cfg = tmp_path / "learn.toml"
    cfg.write_text((REPO / "configs" / "quickstart.toml").read_text()
                   .replace('name = "quickstart"', 'name = "learn"')
                   .replace('model_path = "../assets/qwen3-tiny"', f'model_path = "{tiny_model_dir}"\n'
                            f'output_dir = "{tmp_path / "runs"}"'))
    out = jaxrl("run", str(cfg), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "runs" / "learn")]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"reward/mean: first 3 steps {first:.3f}, last 3 steps {last:.3f}: {rewards}")
    assert last > first + 0.1
