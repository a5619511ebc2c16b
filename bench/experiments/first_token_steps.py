"""How many engine steps a request waits for its first token under shared-prefix arrivals, with
the prefix cache on and off: a count that does not depend on the host's or the GPU's speed, to
read beside a TTFT measured in milliseconds (issue 23's "TTFT p50 >= 3x better").

tiny-llama with random weights on the host driver's VMM arena (16-token blocks), 16 slots, 64-
token chunks; 16 groups x 4 prompts of a 4-block system prompt and an 8-token question, 32
tokens out; a request every `gap` steps on average (Poisson), as a server's arrivals land
between steps.

    python bench/experiments/first_token_steps.py [gap]

Each count is split by whether a decode call had been dispatched ahead when the request came
(Engine(decode_ahead)): such a request waits one more step, the call ahead's, before any call
can prefill it.

On this repository's CPU (2026-12-08, tree b4509a2) at gap 5 (about 8 requests running), as
(steps: requests), with a call ahead / without:
- cache on: {2: 40, 3: 11} / {1: 7, 2: 6};
- cache off: {3: 45} / {2: 15, 3: 4} (a 72-token prompt is two 64-token pieces).
So the cache saves one step (one piece) here, and the call ahead costs one. At gap 2 (the
slots full) the queue's wait spreads both to 17-19 steps.
"""

import collections
import sys

import numpy as np

import jax_kv.models as jm
from jax_kv.engine import Engine
from jax_kv.memory import host_arena

BLOCK = 16  # tokens a granule holds: tiny-llama's tokens are 512 bytes a layer


def steps_to_first_token(model, prompts, gaps, prefix_cache: bool) -> collections.Counter:
    """Serves `prompts`, the i-th submitted gaps[i-1] steps after the one before it ->
    {(a decode call was dispatched ahead at submit, steps from submit to first token):
    requests}."""
    arena = host_arena(reserve_bytes=1 << 30, granule=BLOCK * 512)
    eng = Engine(model, arena=arena, max_slots=16, max_len=512, prefill_chunk_tokens=64,
                 prefix_cache=prefix_cache)  # fmt: skip
    waiting, counts = [], collections.Counter()  # counts: {(ahead, steps): requests}
    step, i, next_arrival = 0, 0, 0
    with eng:
        while i < len(prompts) or eng.has_work():
            while i < len(prompts) and step >= next_arrival:
                ahead = eng._next is not None  # a decode call dispatched by the last step
                waiting.append((eng.submit(prompts[i], 32, stop_token_ids=[]), step, ahead))
                next_arrival = step + gaps[i]
                i += 1
            eng.step()
            step += 1
            for w in [w for w in waiting if w[0].streamed]:
                counts[w[2], step - w[1]] += 1
                waiting.remove(w)
    assert not waiting, f"{len(waiting)} requests never had a token"
    arena.close()
    return counts


def main() -> None:
    gap = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    model = jm.random_model("tiny-llama", seed=0)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    system = [[int(t) for t in rng.integers(3, vocab, 4 * BLOCK)] for _ in range(16)]
    prompts = [s + [int(t) for t in rng.integers(3, vocab, 8)] for _ in range(4) for s in system]
    gaps = rng.poisson(gap, len(prompts))
    for on in (True, False):
        counts = steps_to_first_token(model, prompts, gaps, on)
        split = [{s: n for (a, s), n in sorted(counts.items()) if a == ahead} for ahead in (1, 0)]
        print(
            f"prefix cache {'on ' if on else 'off'}: steps to the first token (steps: "
            f"requests), with a call ahead at submit {split[0]}, without {split[1]}"
        )


if __name__ == "__main__":
    main()
