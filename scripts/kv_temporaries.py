"""The decode step's temporaries against its KV cache, per cache kind (`jaxrl.kv`), compiled for ONE TPU chip
(a v5p-8 topology's first device: the whole cache on one device, as on a single GPU) from this CPU host:
Qwen3-4B's shape at `--layers` layers, `--slots` slots x `--seq` positions, bf16, `Engine._generate` with
truncating sampling and the repetition penalty (the largest variant). A step that copies its cache shows
temporaries near the cache's size (issue 40: "no step copies the cache").

    python scripts/kv_temporaries.py --slots 64 --seq 8192 --layers 2
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from jaxrl.compile import programs, slices
from jaxrl.inference.engine import Engine
from jaxrl.inference.engine_params import EngineParams
from jaxrl.kv.dense import Dense
from jaxrl.kv.paged import Paged
from jaxrl.kv.pallas import PagedPallas
from jaxrl.model import catalog
from jaxrl.model.config import ModelConfig
from jaxrl.parallel.sharding import make_mesh


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    a = p.parse_args()
    model = ModelConfig.from_hf(catalog.HOSTED_MODELS["Qwen/Qwen3-4B-Instruct-2507"])
    mesh = make_mesh({}, slices.topology_devices(slices.parse_slice("v5p-8"))[:1])
    s = programs.Shapes(model, jnp.bfloat16, 16, ("q_proj", "k_proj", "v_proj", "o_proj"), 2.0, True, a.slots,
                        a.seq, 1, a.slots).at_depth(a.layers)
    base, lora = programs._weights(s, mesh)
    params = EngineParams(base=base, lora=lora)
    pool = a.slots * a.seq
    for kind in (Dense(s.model, a.slots, a.seq), Paged(s.model, a.slots, a.seq, pool),
                 PagedPallas(s.model, a.slots, a.seq, pool)):
        engine = Engine(s.model, mesh, a.slots, a.seq, lora_scale=s.lora_scale, cache_dtype=s.dtype, kv=kind)
        state = programs.abstract_decode_state(engine)
        lowered = engine._generate.lower(params, state, truncate=True, penalize=True)
        temp = lowered.compile().memory_analysis().temp_size_in_bytes
        cache = programs.shard_bytes(state.cache)
        print(f"{type(kind).__name__:12s} kv_cache {cache / 2**30:.3f} GiB  temporaries {temp / 2**30:.3f} GiB "
              f"({temp / cache:.1%})", flush=True)


if __name__ == "__main__":
    main()
