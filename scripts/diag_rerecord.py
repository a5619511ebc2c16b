"""Device diagnostic: which buffer moves when the decode step's CUDA graph is re-recorded.
Runs variants (growth or none, preallocated BFC, the parity child's checkpoint with torch on
the GPU) in fresh processes and prints, per decode call, the handlers' host calls and which
step input/output pointers changed from the call before (bench/NOTES.md, the 2026-12-04
re-record; bench/results/issue19_20_h200_eb6c4a1.log).

    python scripts/diag_rerecord.py
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys, tempfile
sys.path.insert(0, "tests/models")
import numpy as np
import jax, jax.numpy as jnp
import jax_kv.models as jm
from jax_kv.decode import Generator
source, torch_gpu, bound, mb = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", int(sys.argv[4])
if source == "hf":
    from model_ref import import_reference, make_hf_model
    ref = import_reference()
    hf = make_hf_model(ref, "llama-untied-llama3")
    tmp = tempfile.mkdtemp(); hf.save_pretrained(tmp)
    model = jm.load(tmp, dtype="bfloat16", progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (5, 11, 3)]
    if torch_gpu:
        hf = hf.to(device="cuda", dtype=ref.torch.bfloat16)
else:
    model = jm.random_model("tiny-llama", seed=0, dtype=jnp.bfloat16)
    prompts = [[5, 6, 7, 8, 9], list(range(3, 14)), [3, 4, 5]]
gen = Generator(model, min_bucket=mb)
gen._bound_writes = bound
orig = gen._call
trace = []
def ptr(a):
    try:
        return a.unsafe_buffer_pointer()
    except Exception:
        try:
            return jax.random.key_data(a).unsafe_buffer_pointer()
        except Exception:
            return None
def traced(key, args, stats):
    ins = {}
    if key.kind == "decode":
        ins = dict(in_tok=ptr(args[1]), in_len=ptr(args[3]), committed=ptr(args[4]),
                   last=ptr(args[5]), in_rng=ptr(args[6]), k0=ptr(args[2][0][0]))
    out, compiled = orig(key, args, stats)
    if key.kind == "decode":
        emitted, next_tok, caches, lengths, rng = out
        ins.update(emitted=ptr(emitted), out_tok=ptr(next_tok), out_len=ptr(lengths),
                   out_rng=ptr(rng), out_k0=ptr(caches[0][0]))
        trace.append(ins)
    return out, compiled
gen._call = traced
out = gen.generate(prompts, 64, stop_tokens=())
s = out.stats
print(json.dumps(dict(calls=s.host_calls_per_step, growth=[d.token_index for d in s.decisions],
                      cap=model.config.max_position_embeddings, trace=trace)))
"""


def main() -> None:
    import os

    pre = dict(XLA_PYTHON_CLIENT_PREALLOCATE="true", XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
    variants = [
        (("random", "0", "1", "16"), {}),
        (("random", "0", "1", "128"), {}),
        (("random", "0", "1", "16"), pre),
        (("hf", "1", "1", "128"), {}),
    ]
    for v, env in variants:
        r = subprocess.run(
            [sys.executable, "-c", CHILD, *v],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        )
        if r.returncode:
            print(v, "FAILED", r.stderr[-3000:])
            continue
        d = json.loads(r.stdout.strip().splitlines()[-1])
        calls, trace = d["calls"], d["trace"]
        print(f"== source={v[0]} torch_gpu={v[1]} bound={v[2]} min_bucket={v[3]} env={env}")
        em = [t["emitted"] for t in trace]
        base = min(em)
        print("   emitted offsets", [e - base for e in em])
        print(f"   host calls {calls}; growth before tokens {d['growth']}")
        for i, t in enumerate(trace):
            prev = trace[i - 1] if i else {}
            moved = [k for k in t if i and t[k] != prev.get(k)]
            moved = [k for k in moved if k != "emitted"]
            if i == 0 or moved or (calls and calls[i]):
                print(f"   call {i:2d} host {calls[i] if calls else '-'} moved {moved}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
