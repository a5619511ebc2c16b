"""CPU reference handlers: max |error| vs the float64 reference per op and dtype, and the
time of a one-layer decode step at B=4, S=4096 (Hq=32, Hkv=8, D=128).

    python bench/cpu_reference.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from reference import gqa_attention_ref, gqa_decode_ref  # noqa: E402

from jax_kv import Layout, gqa_decode, gqa_prefill  # noqa: E402

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def max_errors(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    B, T, Hq, Hkv, D, S = 4, 16, 32, 8, 128, 512
    for name, dtype in DTYPES.items():
        for layout in Layout:

            def r(*shape, dtype=dtype):
                return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

            kc, vc = (r(*layout.cache_shape(B, S, Hkv, D)) for _ in range(2))
            lengths = np.array([0, 1, S - T, 300], np.int32)
            q, k, v = r(B, T, Hq, D), r(B, T, Hkv, D), r(B, T, Hkv, D)
            out, _, _ = gqa_prefill(q, k, v, kc, vc, jnp.asarray(lengths), layout=layout)
            ref, _, _ = gqa_attention_ref(q, k, v, kc, vc, lengths, layout=int(layout))
            prefill_err = float(np.max(np.abs(np.asarray(out, np.float64) - ref)))
            lengths = np.array([0, 1, S - 1, 300], np.int32)
            q, k, v = r(B, Hq, D), r(B, Hkv, D), r(B, Hkv, D)
            out, _, _ = gqa_decode(q, k, v, kc, vc, jnp.asarray(lengths), layout=layout)
            ref, _, _ = gqa_decode_ref(q, k, v, kc, vc, lengths, layout=int(layout))
            decode_err = float(np.max(np.abs(np.asarray(out, np.float64) - ref)))
            rows.append(
                dict(dtype=name, layout=layout.name, decode=decode_err, prefill=prefill_err)
            )
    return rows


def decode_step_time(B=4, S=4096, Hq=32, Hkv=8, D=128, repeats=20) -> float:
    layout = Layout.SEQ_MAJOR
    rng = np.random.default_rng(1)
    shape = layout.cache_shape(B, S, Hkv, D)
    kc = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, Hq, D), np.float32), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, Hkv, D), np.float32), jnp.bfloat16)
    lengths = jnp.full((B,), S - 1, jnp.int32)
    step = jax.jit(
        lambda q, k, kc, vc, n: gqa_decode(q, k, k, kc, vc, n, layout=layout), donate_argnums=(2, 3)
    )
    _, kc, vc = jax.block_until_ready(step(q, k, kc, vc, lengths))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, kc, vc = jax.block_until_ready(step(q, k, kc, vc, lengths))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    rows = max_errors()
    print(
        "max |out - float64 reference| (B=4, Hq=32, Hkv=8, D=128, S=512; decode lengths "
        "0, 1, 511, 300; prefill T=16 after 0, 1, 496, 300)"
    )
    print(f"{'dtype':>9} {'layout':>10} {'decode':>10} {'prefill':>10}")
    for r in rows:
        print(f"{r['dtype']:>9} {r['layout']:>10} {r['decode']:10.2e} {r['prefill']:10.2e}")
    t = decode_step_time()
    print(
        f"one-layer decode step, B=4, S=4096 (all live), bf16, Hq=32, Hkv=8, D=128, CPU "
        f"reference: {t * 1e3:.2f} ms (median of 20)"
    )
    if args.out:
        args.out.write_text(
            json.dumps(dict(errors=rows, decode_step_s=t, jax=jax.__version__), indent=2)
        )


if __name__ == "__main__":
    main()
