"""Where do the engine's greedy tokens part from Generator's alone, and is it the engine?

`test_bf16_real_model_first_32_tokens_agree_with_generator` (SmolLM2-135M-Instruct, bf16, 100
chat prompts) found 52 of 100 requests equal in their first 32 tokens on the H100. This
separates the causes, with Generator alone (one prompt, batch 1) as the reference:

- engine x16: the 16-slot engine (rows batched, packed prefill in chunks);
- engine x1: a 1-slot engine (the packed prefill and the engine's step, no batching);
- engine x1 unsplit: the same with the Generator's prefill chunk (no prompt split);
- generator x16: Generator on batches of 16 prompts (padded prefill, rows batched);

in bf16 and in f32 (matmuls at "highest": no TF32). If the engine only reorders sums, f32
agrees (near) everywhere and generator x16 parts from generator x1 about as often as the
engine does in bf16.

    JAX_KV_TEST_GGUF=/tmp/smollm2.gguf python3 bench/experiments/bf16_agreement.py [n] [bf16]

XLA's options that make its GEMMs' rows independent of M (M >= 2; `gemm_row_invariance.py`)
and its fusions round every op as the HLO says (`--xla_allow_excess_precision=false`) go in
XLA_FLAGS: they separate XLA's program-dependent rounding from the attention kernels'.

Without JAX_KV_TEST_GGUF it runs SmolLM2-135M's shape with seeded random weights on random
prompts of 20-300 tokens (a random model's logits are flatter, so near-ties are commoner).
"""

import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_kv.models as jm
from jax_kv import Engine, Generator

# The GPU test's 100 chat prompts (tests/engine/chat_prompts.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))
from chat_prompts import CHAT_TEXTS  # noqa: E402

N_NEW = 32
MAX_LEN = 1024


def arena():
    if jax.default_backend() == "gpu":
        from jax_kv.memory import VmmArena

        return VmmArena(pool_bytes=0)
    return None


def engine_tokens(model, prompts, slots, chunk=256):
    kw = {"arena": arena()} if jax.default_backend() == "gpu" else {}
    with Engine(model, max_slots=slots, max_len=MAX_LEN, prefill_chunk_tokens=chunk, **kw) as eng:
        reqs = [eng.submit(p, N_NEW, stop_token_ids=[]) for p in prompts]
        eng.run_until_idle()
        return [r.result().tokens for r in reqs]


def generator_tokens(model, prompts, batch):
    kw = {"arena": arena()} if jax.default_backend() == "gpu" else {}
    gen = Generator(model, max_len=MAX_LEN, **kw)
    out = []
    for i in range(0, len(prompts), batch):
        out += gen.generate(prompts[i : i + batch], N_NEW, stop_tokens=[]).tokens
    return out


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    path = os.environ.get("JAX_KV_TEST_GGUF")
    texts = CHAT_TEXTS[:n]
    runs_of = ((jnp.bfloat16, "default"), (jnp.float32, "highest"))
    if sys.argv[2:] == ["bf16"]:  # bf16 alone (f32 agreed in every run so far)
        runs_of = runs_of[:1]
    for dtype, precision in runs_of:
        jax.config.update("jax_default_matmul_precision", precision)
        if path:
            model = jm.load(path, dtype)
            chats = [[{"role": "user", "content": t}] for t in texts]
            ps = [model.encode(model.apply_chat_template(c)) for c in chats]
        else:
            model = jm.random_model("smollm2-135m", seed=0, dtype=dtype)
            rng = np.random.default_rng(0)
            vocab = model.config.vocab_size
            ps = [rng.integers(0, vocab, int(rng.integers(20, 300))).tolist() for _ in range(n)]
        t0 = time.perf_counter()
        runs = {
            "generator x1": generator_tokens(model, ps, 1),
            "generator x16": generator_tokens(model, ps, 16),
            "engine x1": engine_tokens(model, ps, 1),
            # The Generator's prefill chunk (4,096): no prompt split, as in the Generator.
            "engine x1 unsplit": engine_tokens(model, ps, 1, chunk=4096),
            "engine x16": engine_tokens(model, ps, 16),
        }
        ref = runs["generator x1"]
        name = jnp.dtype(dtype).name
        took = time.perf_counter() - t0
        what = "trained" if path else "random"
        print(f"{name} ({what} weights, matmul precision {precision}), {n} prompts, {took:.0f} s:")
        for label, toks in runs.items():
            if label == "generator x1":
                continue
            ds = [first_difference(a, b) for a, b in zip(toks, ref, strict=True)]
            parted = sorted(d for d in ds if d is not None)
            print(f"  {label:14s} vs generator x1: {n - len(parted)} of {n} equal in "
                  f"{N_NEW} tokens; first differences at {parted}")  # fmt: skip
        pairs = zip(runs["engine x16"], runs["generator x16"], strict=True)
        ds = [first_difference(a, b) for a, b in pairs]
        print(f"  engine x16 vs generator x16: {sum(d is None for d in ds)} of {n} equal")
        del model


if __name__ == "__main__":
    main()
