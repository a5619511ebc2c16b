"""Which of the steps' ops give a row the same bits alone and among others, compiled with the
steps' own options (jax_kv.config.step_compiler_options: run with JAX_KV_BATCH_INVARIANT=1 to
check the batch-invariant mode's, without it for XLA's defaults)?

- GEMMs as the models call them (bf16 x [M, K] @ w[N, K].T, bf16 out), SmolLM2-135M's and
  Llama-3-8B's projection shapes: rows 0-1 at M = 16 .. 2048 against the same rows at M = 2;
  and the square ones through the models' projection with a residual add (project);
- RMSNorm (jax_kv.ops.norm.rms_norm): row 0 among M rows against alone;
- the packed prefill kernel (gqa_prefill_packed): a 40-token sequence alone (N = 64) against
  the same sequence as the 6th of 16 packed (N = 1024), its output rows.

    JAX_KV_BATCH_INVARIANT=1 python bench/experiments/batch_invariance_ops.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from jax_kv import Layout, gqa_prefill_packed
from jax_kv.config import runtime_config, step_compiler_options
from jax_kv.models.projection import project
from jax_kv.ops.norm import rms_norm

SHAPES = {  # name: (N, K) of w
    "135m.q": (576, 576),
    "135m.kv": (192, 576),
    "135m.gate": (1536, 576),
    "135m.down": (576, 1536),
    "135m.logits": (49152, 576),
    "8b.q": (4096, 4096),
    "8b.kv": (1024, 4096),
    "8b.gate": (14336, 4096),
    "8b.down": (4096, 14336),
}
ROWS = (16, 64, 128, 256, 512, 768, 1024, 2048)


def main() -> None:
    options = step_compiler_options()
    print(f"{jax.devices()[0].device_kind}, batch-invariant mode "
          f"{runtime_config().batch_invariant}, options {options}")  # fmt: skip
    rng = np.random.default_rng(0)
    matmul = jax.jit(lambda x, w: jnp.matmul(x, w.T), compiler_options=options)
    # The models' projection with its residual add, which XLA may fold into the GEMM (the
    # H100's decode parted first at an o-projection with equal inputs): square shapes only.
    residual = jax.jit(lambda x, w: project(x, w, residual=x), compiler_options=options)

    def moved(f, x, w):  # {M: values of rows 0-1 that differ from the same rows at M = 2}
        ref = np.asarray(f(x[:2], w).astype(jnp.float32))
        return {m: int((np.asarray(f(x[:m], w)[:2].astype(jnp.float32)) != ref).sum())
                for m in ROWS}  # fmt: skip

    for name, (n, k) in SHAPES.items():
        w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((max(ROWS), k)), jnp.bfloat16)
        print(f"GEMM {name}: values of rows 0-1 that differ from M = 2, by M: "
              f"{moved(matmul, x, w)}")  # fmt: skip
        if n == k:
            print(f"GEMM + residual {name}: values of rows 0-1 that differ from M = 2: "
                  f"{moved(residual, x, w)}")  # fmt: skip

    h = 4096
    weight = jnp.asarray(rng.standard_normal(h), jnp.bfloat16)
    norm = jax.jit(lambda x: rms_norm(x, weight, 1e-5), compiler_options=options)
    x = jnp.asarray(rng.standard_normal((2048, h)) * 3, jnp.bfloat16)
    ref = np.asarray(norm(x[:1]).astype(jnp.float32))
    moved = {m: int((np.asarray(norm(x[:m])[:1].astype(jnp.float32)) != ref).sum())
             for m in (2,) + ROWS}  # fmt: skip
    print(f"RMSNorm H={h}: values of row 0 that differ from alone, by M: {moved}")

    hq, hkv, d, s = 32, 8, 128, 2048
    lens = [int(v) for v in rng.integers(20, 60, 16)]
    lens[5] = 40
    total = sum(lens)
    q = jnp.asarray(rng.standard_normal((1024, hq, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1024, hkv, d)), jnp.bfloat16)
    start = sum(lens[:5])

    def prefill(q, k, v, batch, cu):
        cache = jnp.zeros((batch, s, hkv, d), jnp.bfloat16)
        lengths = jnp.zeros((batch,), jnp.int32)
        return gqa_prefill_packed(q, k, v, cache, cache, lengths, cu, layout=Layout.SEQ_MAJOR)[0]

    run = jax.jit(prefill, static_argnums=3, compiler_options=options)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    packed = run(q, kv, kv, 16, cu)[start : start + 40]
    one = lambda a: jnp.zeros((64, *a.shape[1:]), a.dtype).at[:40].set(a[start : start + 40])  # noqa: E731
    alone = run(one(q), one(kv), one(kv), 1, jnp.asarray([0, 40], jnp.int32))[:40]
    parted = int(
        (np.asarray(alone.astype(jnp.float32)) != np.asarray(packed.astype(jnp.float32))).sum()
    )
    print(f"packed prefill: values of a 40-token sequence that differ alone (N = 64) against "
          f"6th of 16 ({total} tokens, N = 1024): {parted}")  # fmt: skip


if __name__ == "__main__":
    main()
