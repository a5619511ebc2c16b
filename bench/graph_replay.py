"""Does the decode step's recorded CUDA graph survive growth? Runs the Generator (tiny random
Llama, bf16, seq-major on VMM, min_bucket 16, 64 new tokens, prompts of 5, 11 and 3 tokens) in
fresh processes and prints, per decode call, how often the CUDA handlers' host code ran (XLA
runs it only while recording: 0 = replayed), beside the tokens before which the cache grew.
`--compare` also runs the steps without the committed bound and status (the pre-issue-19
path), to tell a re-record that the bound causes from one the allocator causes.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/graph_replay.py --runs 3 --compare
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, sys
import jax.numpy as jnp
import jax_kv.models as jm
from jax_kv.decode import Generator
gen = Generator(jm.random_model("tiny-llama", seed=0, dtype=jnp.bfloat16), min_bucket=16,
                tokens_per_call=int(sys.argv[2]))
gen._bound_writes = sys.argv[1] == "bound"
out = gen.generate([[5, 6, 7, 8, 9], list(range(3, 14)), [3, 4, 5]], 64, stop_tokens=())
s = out.stats
print(json.dumps(dict(calls=s.host_calls_per_step, growth=[d.token_index for d in s.decisions],
                      kept=[d.kept for d in s.decisions], captures=s.captures,
                      granules=[d.granules_committed for d in s.decisions])))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens-per-call", type=int, default=1)
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args()
    paths = ["bound", "unbound"] if args.compare else ["bound"]
    for path in paths:
        for run in range(args.runs):
            r = subprocess.run(
                [sys.executable, "-c", CHILD, path, str(args.tokens_per_call)],
                capture_output=True,
                text=True,
            )
            if r.returncode:
                print(r.stderr[-2000:])
                raise SystemExit(1)
            d = json.loads(r.stdout.strip().splitlines()[-1])
            calls = d["calls"] or []  # None without the CUDA module
            warm = calls.index(0) if 0 in calls else None
            late = [i for i, c in enumerate(calls) if warm is not None and i > warm and c]
            print(
                f"{path:8s} run {run}: captures {d['captures']}, growth before tokens "
                f"{d['growth']} (kept {d['kept']}, granules mapped {d['granules']}), recorded "
                f"at calls 0-{warm}, re-recorded at "
                f"calls {late or 'none'}: {calls}",
                flush=True,
            )


if __name__ == "__main__":
    main()
