"""The batch-invariant mode (JAX_KV_BATCH_INVARIANT=1; issue 21, item 6): a row's logits are
meant to be the same bits whatever is computed beside it, so that greedy tokens from a batched
Engine equal the request's tokens from Generator alone in bf16 too.

What this CPU can check: the one-row paths the mode removes. XLA computes a matmul of one row
(Generator alone, M = 1) on a matrix-vector path that sums in another order than any M >= 2,
and a decode step's logits for a row alone and in a batch then differ everywhere. It cannot
check the rest: XLA's CPU backend also picks reductions by size (RMSNorm's sum of squares ran
as a YNNPACK fusion at 16 rows, as a reduce-window tree at 2), which parts a few values of
some trained-weight rows, so the CPU's trained-weights agreement rose from 13 to 19 of 24 with
the mode, not to 24 (bench/NOTES.md, "The batch-invariant mode"). The GPU's causes (XLA's per-M
GEMM choices, the decode kernel's split plan from the batch) are checked on the device
(tests/engine/test_engine_gpu.py, tests/ops/test_gpu_ops.py). Each case runs in its own
process: the config is read once per process."""

import pytest
from processes import run

# One decode step of SmolLM2-135M's shape (random bf16 weights, random caches) for 4 rows, and
# for row 0 alone: whether row 0's logits are the same bits, their largest difference, and how
# many of them differ.
ROW_ALONE_AND_IN_A_BATCH = """
import jax, jax.numpy as jnp, numpy as np
import jax_kv.models as jm
from jax_kv.config import step_compiler_options
from jax_kv.layout import Layout
from jax_kv.models import llama

model = jm.random_model("smollm2-135m", seed=0, dtype=jnp.bfloat16)
config, layout = model.config, Layout.SEQ_MAJOR
rng = np.random.default_rng(0)
caches = [
    tuple(jnp.asarray(rng.standard_normal(c.shape, np.float32), c.dtype) for c in kv)
    for kv in llama.init_caches(config, 4, 64, layout=layout, dtype=jnp.bfloat16)
]
tokens = jnp.asarray(rng.integers(0, config.vocab_size, 4), jnp.int32)
lengths = jnp.asarray([10, 20, 30, 40], jnp.int32)
step = jax.jit(
    lambda p, t, c, n: llama.decode_step(p, config, t, c, n, layout=layout)[0],
    compiler_options=step_compiler_options(),
)
batched = np.asarray(step(model.params, tokens, caches, lengths)[0], np.float32)
alone = step(model.params, tokens[:1], [(k[:1], v[:1]) for k, v in caches], lengths[:1])
alone = np.asarray(alone[0], np.float32)
assert not np.isnan(alone).any()
print(bool((batched == alone).all()), float(np.abs(batched - alone).max()),
      int((batched != alone).sum()))
"""


def _last_line(code: str, **env: str) -> str:
    r = run(code, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_a_row_decoded_alone_has_the_bits_it_has_in_a_batch():
    same, largest, count = _last_line(ROW_ALONE_AND_IN_A_BATCH, JAX_KV_BATCH_INVARIANT="1").split()
    assert same == "True" and float(largest) == 0.0 and count == "0", (largest, count)
    # Without the mode the same step parts (here: every logit of the row): the test tells the
    # mode apart on this platform, or says it cannot.
    same, largest, count = _last_line(ROW_ALONE_AND_IN_A_BATCH).split()
    print(f"\ndefault mode: row 0 alone against in a batch of 4: {count} logits differ, "
          f"the largest by {largest}")  # fmt: skip
    if same == "True":
        pytest.skip("this platform's one-row matmul sums as M >= 2 does: nothing to tell apart")
