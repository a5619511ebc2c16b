"""Where in the 4-slot prefix test does compute-sanitizer's own process crash?

`tests/engine/test_engine_gpu.py::test_prefix_cache_on_cuda_shares_granules_and_keeps_tokens`
crashed compute-sanitizer 2025.3.1 (SIGSEGV in the tool's process, exit 139) within ~8 s with
every option set tried, even with a kernel filter that matches no kernel, while the 2-slot
prefix test and `bench/experiments/sanitizer_multimap.py` ran to the end. This replays the
4-slot test's sequence (same model, prompts and steps) and prints a line before each engine
call, flushed, so the last line a run under the sanitizer printed names the call in flight:

    compute-sanitizer --tool memcheck --report-api-errors no \\
        python3 bench/experiments/sanitizer_prefix_steps.py
"""

import dataclasses
import sys

import jax.numpy as jnp
import numpy as np

import jax_kv.models as jm
from jax_kv.engine import Engine
from jax_kv.memory import VmmArena


def say(text):
    print(text, flush=True)


def serve(model, prompts, prefix_cache, tag):
    say(f"{tag}: VmmArena(pool_bytes=0)")
    arena = VmmArena(pool_bytes=0)
    say(f"{tag}: Engine(max_slots=4, prefix_cache={prefix_cache})")
    eng = Engine(model, max_slots=4, max_len=3072, prefill_chunk_tokens=512, arena=arena,
                 prefix_cache=prefix_cache)  # fmt: skip
    reqs = [eng.submit(prompts[0], 24, stop_token_ids=[])]
    steps = 0

    def step(what):
        nonlocal steps
        say(f"{tag}: step {steps} ({what}; committed {eng.cache.committed_bytes >> 20} MiB)")
        eng.step()
        eng.check_memory()
        steps += 1

    for _ in range(4):
        step("the lead's prefill")
    reqs += [eng.submit(p, 24, stop_token_ids=[]) for p in prompts[1:]]
    while eng.has_work():
        step("followers")
    turn = prompts[0] + reqs[0].result().tokens + [5, 6, 7]
    reqs.append(eng.submit(turn, 8, stop_token_ids=[]))
    while eng.has_work():
        step("a chat turn")
    say(f"{tag}: engine close")
    eng.close()
    say(f"{tag}: arena close")
    arena.close()
    s = arena.stats()
    say(f"{tag}: handles live {s.handles_live}, faults {dict(s.faults)}")
    return [r.result().tokens for r in reqs]


def main():
    config = dataclasses.replace(
        jm.PRESETS["tiny-llama"], num_q_heads=16, num_kv_heads=8, head_dim=128,
        hidden_size=512, max_position_embeddings=4096,
    )  # fmt: skip
    model = jm.random_model(config, seed=3, dtype=jnp.float32)
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    vocab = config.vocab_size
    prefix = [int(t) for t in rng.integers(3, vocab, 1100)]
    prompts = [prefix + [int(t) for t in rng.integers(3, vocab, 20)] for _ in range(4)]
    on = serve(model, prompts, None, "cache on")
    off = serve(model, prompts, False, "cache off")
    say(f"done: tokens equal on and off: {on == off}")


if __name__ == "__main__":
    main()
