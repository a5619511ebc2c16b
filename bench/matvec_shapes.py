"""Runs each decode projection of a model shape at B=1 through `matvec` and `xla_matvec`, a few
times each, for a kernel profiler to read (nothing is timed here):

    ncu --clock-control none -k regex:"Matvec|reduce" --launch-skip 8 --launch-count 8 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 bench/matvec_shapes.py --model qwen2.5-0.5b

The projections are the models' fused forms: attn_norm + q/k/v (+ bias), o + residual,
mlp_norm + gate/up + SwiGLU, down + residual; random bf16 weights of the preset's shape.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_kv.models as jm
from jax_kv.ops.matvec import matvec, xla_matvec


def projections(config) -> dict[str, tuple[int, int, dict]]:
    """name -> (rows of w, K, keyword arguments) of one layer's four projections."""
    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim
    o_in = config.num_q_heads * config.head_dim
    return {
        "qkv+norm": (qkv, h, dict(norm=True)),
        "o+residual": (h, o_in, dict(residual=True)),
        "gate_up+norm+swiglu": (2 * i, h, dict(norm=True, activation="swiglu")),
        "down+residual": (h, i, dict(residual=True)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--calls", type=int, default=12, help="calls of each projection and impl")
    args = ap.parse_args()
    config = jm.preset(args.model)
    rng = np.random.default_rng(0)
    for name, (W, K, kw) in projections(config).items():
        act = kw.get("activation")
        N = W // 2 if act else W
        x = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((W, K)) / np.sqrt(K), jnp.bfloat16)
        g = jnp.asarray(rng.standard_normal(K), jnp.bfloat16) if kw.get("norm") else None
        r = jnp.asarray(rng.standard_normal((1, N)), jnp.bfloat16) if kw.get("residual") else None
        for impl in (matvec, xla_matvec):
            fn = jax.jit(
                lambda x, w, g, r, impl=impl, act=act: impl(
                    x, w, norm=g, activation=act, residual=r
                )
            )
            for _ in range(args.calls):
                y = fn(x, w, g, r)
            jax.block_until_ready(y)
            print(f"{name:22s} {impl.__name__:10s} w {W}x{K} -> y {tuple(y.shape)}")


if __name__ == "__main__":
    main()
