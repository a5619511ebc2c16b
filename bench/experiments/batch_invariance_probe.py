"""Does a row's decode step give the same bits alone and in a batch, and if not, where do they
part? Run with JAX_KV_BATCH_INVARIANT=1 (the mode under test) or without (the default).

The model (SmolLM2-135M-Instruct from JAX_KV_TEST_GGUF, else its shape with random weights) in
bf16 prefills 16 chat prompts packed in one call (each prompt alone too: their logits must be
equal), then decodes them greedily, the 16 rows together and each of 3 rows alone, comparing
the logits' bits at every step. At the first step where a row alone parts from the same row in
the batch, it runs that step once more with every projection's input and output recorded (the
model's `projection` hook) and names the first projection whose input already differs (an op
between projections parted them: a norm, the attention, a residual add) or whose input is equal
and output is not (the GEMM itself).

    JAX_KV_BATCH_INVARIANT=1 JAX_KV_TEST_GGUF=/tmp/smollm2.gguf \\
        python bench/experiments/batch_invariance_probe.py [steps]

On this repository's CPU with trained weights: with the mode's first form (no fixed-order
RMSNorm) the prefills agreed and row 9's step 2 parted at layer 3's q projection's input (3 of
576 values): RMSNorm's sum of squares ran as a YNNPACK fusion in the 16-row program and as a
reduce-window tree in the 2-row one. With the mode as it is, rows 4, 8 and 9 stay equal to the
batch's for 20 steps (bench/NOTES.md, "The batch-invariant mode").
"""

import itertools
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_kv.models as jm
from jax_kv.config import runtime_config, step_compiler_options
from jax_kv.layout import Layout
from jax_kv.models import llama
from jax_kv.models.projection import project

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))
from chat_prompts import CHAT_TEXTS  # noqa: E402

LAYOUT = Layout.SEQ_MAJOR
CAPACITY = 512
ALONE = (4, 8, 9)  # rows decoded alone beside the batch (those the CPU saw part)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    path = os.environ.get("JAX_KV_TEST_GGUF")
    if path:
        model = jm.load(path, jnp.bfloat16)
        chats = [[{"role": "user", "content": t}] for t in CHAT_TEXTS[:16]]
        prompts = [model.encode(model.apply_chat_template(c)) for c in chats]
    else:
        model = jm.random_model("smollm2-135m", seed=0, dtype=jnp.bfloat16)
        rng = np.random.default_rng(0)
        vocab = model.config.vocab_size
        prompts = [rng.integers(0, vocab, int(rng.integers(20, 60))).tolist() for _ in range(16)]
    config, params = model.config, model.params
    mode = runtime_config().batch_invariant
    weights = "trained" if path else "random"
    print(f"{jax.devices()[0].device_kind}, batch-invariant mode {mode}, {weights} weights, bf16")
    options = step_compiler_options()
    prefill = jax.jit(
        lambda p, t, cu, c, n: llama.prefill_packed(p, config, t, cu, c, n, layout=LAYOUT),
        compiler_options=options,
    )

    def prefilled(rows):
        tokens = np.concatenate([prompts[i] for i in rows]).astype(np.int32)
        padded = np.zeros(1 << int(np.ceil(np.log2(max(16, len(tokens))))), np.int32)
        padded[: len(tokens)] = tokens
        cu = np.concatenate([[0], np.cumsum([len(prompts[i]) for i in rows])]).astype(np.int32)
        caches = llama.init_caches(config, len(rows), CAPACITY, layout=LAYOUT, dtype=jnp.bfloat16)
        n = jnp.zeros((len(rows),), jnp.int32)
        logits, caches = prefill(params, jnp.asarray(padded), jnp.asarray(cu), caches, n)
        return np.asarray(logits, np.float32), caches

    batch_logits, batch_caches = prefilled(list(range(16)))
    for i in ALONE:
        alone_logits, _ = prefilled([i])
        parted = int((alone_logits[0] != batch_logits[i]).sum())
        print(f"prefill, row {i}: {parted} logits differ alone against packed with 15 others")

    records: dict[int, tuple] = {}

    def recording(row):
        traced = itertools.count()  # a projection's index in the step, taken while tracing

        def projection(x, w, b=None, **kw):
            y = project(x, w, b, **kw)
            j = next(traced)
            keep = lambda xv, yv: records.__setitem__(j, (np.asarray(xv), np.asarray(yv)))  # noqa: E731
            jax.debug.callback(keep, x[row], y[row])
            return y

        return projection

    def decoder(projection=None):
        return jax.jit(
            lambda p, t, c, n: llama.decode_step(
                p, config, t, c, n, layout=LAYOUT, projection=projection
            )[:2],
            compiler_options=options,
        )

    decode = decoder()
    batch = [jnp.asarray(batch_logits.argmax(-1), jnp.int32), batch_caches,
             jnp.asarray([len(p) for p in prompts], jnp.int32)]  # fmt: skip
    alone = {}
    for i in ALONE:
        logits, caches = prefilled([i])
        alone[i] = [jnp.asarray(logits.argmax(-1), jnp.int32), caches,
                    jnp.asarray([len(prompts[i])], jnp.int32)]  # fmt: skip
    traced = set()
    for step in range(steps):
        before = [batch[0], batch[1], batch[2]]
        logits, batch[1] = decode(params, *batch)
        logits = np.asarray(logits, np.float32)
        for i, state in alone.items():
            start = list(state)
            one, state[1] = decode(params, *state)
            one = np.asarray(one, np.float32)
            parted = int((one[0] != logits[i]).sum())
            if parted and i not in traced:
                traced.add(i)
                print(f"step {step}, row {i}: {parted} logits differ, the largest by "
                      f"{float(np.abs(one[0] - logits[i]).max()):.4f}")  # fmt: skip
                records.clear()
                jax.block_until_ready(decoder(recording(i))(params, *before))
                jax.effects_barrier()
                in_batch = [records[j] for j in sorted(records)]
                records.clear()
                jax.block_until_ready(decoder(recording(0))(params, *start))
                jax.effects_barrier()
                alone_records = [records[j] for j in sorted(records)]
                pairs = zip(in_batch, alone_records, strict=True)
                for j, ((xb, yb), (xa, ya)) in enumerate(pairs):
                    dx, dy = int((xb != xa).sum()), int((yb != ya).sum())
                    if dx or dy:
                        where = "its input" if dx else "the GEMM (equal input)"
                        print(f"  first difference at projection {j} of the step "
                              f"({len(in_batch)} in all): {dx} input and {dy} output values "
                              f"differ, so {where}")  # fmt: skip
                        break
            state[0] = jnp.asarray(one.argmax(-1), jnp.int32)
            state[2] = state[2] + 1
        batch[0] = jnp.asarray(logits.argmax(-1), jnp.int32)
        batch[2] = batch[2] + 1
    parted = sorted(traced)
    print(
        f"{steps} steps: rows alone equal to the batch's throughout: "
        f"{[i for i in ALONE if i not in traced]}, parted: {parted}"
    )


if __name__ == "__main__":
    main()
