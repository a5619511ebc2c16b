"""End-to-end decode tokens/s on random-weight models, in one run: the jax_kv Generator
(seq-major and head-major, VMM arena on CUDA), a plain-JAX static-cache loop (a max_len cache,
XLA masked attention and XLA's dots (jax_kv.models.projection.project), the same model code
otherwise, one jitted donated step per token) and
transformers (PyTorch, bf16, static cache); plus committed KV memory against a static cache.

    python bench/generate.py --out DIR [--models smollm2-135m,qwen2.5-0.5b] [--batch 1,32]
        [--prompt 128] [--new-tokens 512] [--static-len 4096] [--impls ...]
    python bench/generate.py --out DIR --report DIR/generate.json

Prints the tables last; writes DIR/generate.json (after every result, so a run cut short keeps
its rows) and DIR/generate.png. `--report JSON` prints the tables and draws the PNG of a saved
run without measuring.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import platform
import subprocess
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_kv.models as jm
from jax_kv.cache import KvCache
from jax_kv.decode import Generator
from jax_kv.decode.sampling import argmax_rows
from jax_kv.layout import Layout
from jax_kv.models import llama
from jax_kv.models.projection import project
from jax_kv.ops.xla_attention import xla_gqa_decode, xla_gqa_prefill

# "@k": k decode steps per jitted call (Generator(tokens_per_call=k)). The unrolled variant "@ku"
# is on branch unroll-tokens (measured slower: bench/NOTES.md). The "+kN" variants (a CUDA decode
# kernel forced for the whole process) went with the process-wide kernel setting (issue 20): the
# kernel a call runs is a function of the call; bench/attention.py --decode-kernel compares them.
IMPLS = ("jax_kv-seq", "jax_kv-head", "jax_kv-seq@8", "plain-jax", "transformers")
MODELS = ("smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3-8b")


def call_options(per_call: str) -> dict:
    """Generator keywords of an impl's "@..." part: "" -> one token per call, "8" -> 8."""
    return dict(tokens_per_call=int(per_call or 1))


def run_generator(
    model, prompts: np.ndarray, new_tokens: int, layout: Layout, per_call: str = ""
) -> dict:
    gen = Generator(model, layout=layout, **call_options(per_call))
    r = gen.generate(prompts.tolist(), new_tokens, stop_tokens=())
    s = r.stats
    calls = s.host_calls_per_step
    return dict(
        tok_s=s.decode_tokens_per_s,
        host_overhead_us=s.host_overhead_us,
        dispatch_us=s.dispatch_us,
        host_overhead_us_per_step=s.host_overhead_us_per_step,
        captures=s.captures,
        replays=s.replays,
        invalidations=s.invalidations,
        growth_events=s.growth_events,
        growth_keeps=s.growth_keeps,
        kv_bytes_moved=s.kv_bytes_moved,
        committed_bytes=s.committed_bytes,
        host_calls_after_first=None if calls is None else int(sum(calls[1:])),
        compile_s=s.compile_seconds,
        arena=s.arena,
    )


def plain_jax_loop(model, prompts: np.ndarray, static_len: int):
    """What a JAX user writes today: a cache at max_len, XLA attention over all of it, XLA's
    dots for the projections; the model code and the greedy argmax are the Generator's, so
    only the cache, the attention and the projections' kernels differ. -> (step, state):
    `state = step(*state)` decodes one token; state[0] is the tokens [B]."""
    config, params = model.config, model.params
    layout = Layout.SEQ_MAJOR
    B, P = prompts.shape
    caches = llama.init_caches(config, B, static_len, layout=layout, dtype=model.dtype)
    prefill = jax.jit(
        functools.partial(
            llama.prefill,
            config=config,
            layout=layout,
            last_only=True,
            attention=xla_gqa_prefill,
            projection=project,
        ),
        donate_argnames=("caches",),
    )

    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def step(params, tokens, caches, lengths):
        logits, caches = llama.decode_step(
            params,
            config,
            tokens,
            caches,
            lengths,
            layout=layout,
            attention=xla_gqa_decode,
            projection=project,
        )
        return argmax_rows(logits), caches, lengths + 1

    lengths = jnp.zeros((B,), jnp.int32)
    logits, caches = prefill(
        params, tokens=jnp.asarray(prompts), new_lengths=None, caches=caches, lengths=lengths
    )
    tok = argmax_rows(logits)
    return functools.partial(step, params), (tok, caches, lengths + P)


def run_plain_jax(model, prompts: np.ndarray, new_tokens: int, static_len: int) -> dict:
    step, state = plain_jax_loop(model, prompts, static_len)
    t0 = time.perf_counter()
    state = step(*state)  # compile
    np.asarray(state[0])
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(new_tokens - 2):
        state = step(*state)
        np.asarray(state[0])  # one sync per token, as the Generator does
    dt = time.perf_counter() - t0
    return dict(tok_s=prompts.shape[0] * (new_tokens - 2) / dt, compile_s=compile_s)


def _hf_config(ref_transformers: Any, config) -> Any:
    kw = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_q_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    cls = "Qwen2Config" if config.qkv_bias else "LlamaConfig"
    return getattr(ref_transformers, cls)(**kw)


def run_transformers(config, prompts: np.ndarray, new_tokens: int) -> dict:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            _hf_config(transformers, config), dtype=torch.bfloat16
        ).eval()
    ids = torch.as_tensor(prompts, device="cuda")

    def gen(n: int, model=model) -> float:
        # disable_compile: transformers 5 otherwise torch.compiles a static-cache decode inside
        # the timed region (seen: 5 tok/s on SmolLM2 while inductor compiled).
        cfg = transformers.GenerationConfig(
            disable_compile=True,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(4)  # warm up
    t1, tn = gen(1), gen(new_tokens)
    del model
    torch.cuda.empty_cache()
    return dict(tok_s=prompts.shape[0] * (new_tokens - 1) / (tn - t1))


def memory_rows(config, dtype, max_len: int = 32768) -> list[dict]:
    """Committed KV bytes of a seq-major VMM cache at live lengths 1k/8k/32k vs a static
    max_len cache (B=1)."""
    rows = []
    static = (
        2
        * config.num_layers
        * max_len
        * config.num_kv_heads
        * config.head_dim
        * jnp.dtype(dtype).itemsize
    )
    for live in (1024, 8192, 32768):
        cache = KvCache(
            num_layers=config.num_layers,
            batch=1,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            layout=Layout.SEQ_MAJOR,
            max_len=max_len,
            initial_tokens=live,
        )
        rows.append(
            dict(
                live=live,
                committed=cache.committed_bytes,
                static=static,
                arena=cache.stats()["arena"],
            )
        )
        cache.close()
    return rows


def run_meta(args) -> dict:
    commit = (
        os.environ.get("JAX_KV_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    dev = jax.devices()[0]
    return dict(
        device=getattr(dev, "device_kind", str(dev)),
        jax=jax.__version__,
        commit=commit,
        python=platform.python_version(),
        prompt=args.prompt,
        new_tokens=args.new_tokens,
        static_len=args.static_len,
        dtype="bfloat16",
        impls=args.impls.split(","),
        # Command-buffer settings change what a call launches: a run names the ones it ran under.
        xla_flags=os.environ.get("XLA_FLAGS", ""),
    )


def measure(args) -> dict:
    """Runs every (model, batch, impl); DIR/generate.json is rewritten after each result, so a
    run cut short by a time limit keeps what it measured."""
    impls = args.impls.split(",")
    data: dict[str, Any] = dict(meta=run_meta(args), rows=[], memory={})

    def save() -> None:
        (args.out / "generate.json").write_text(json.dumps(data, indent=2))

    for name in args.models.split(","):
        config = jm.preset(name)
        model = jm.random_model(config, seed=0, dtype=jnp.bfloat16)
        model.fuse_projections()  # as the Generator does: every implementation gets the same
        for B in (int(b) for b in args.batch.split(",")):
            prompts = (
                np.random.default_rng(0)
                .integers(3, config.vocab_size, (B, args.prompt))
                .astype(np.int32)
            )
            row: dict[str, Any] = dict(model=name, batch=B)
            data["rows"].append(row)
            for impl in impls:
                t0 = time.perf_counter()
                try:
                    if impl.startswith("jax_kv-"):  # jax_kv-seq, jax_kv-head, jax_kv-seq@8
                        kind, _, k = impl.removeprefix("jax_kv-").partition("@")
                        layout = Layout.SEQ_MAJOR if kind == "seq" else Layout.HEAD_MAJOR
                        row[impl] = run_generator(model, prompts, args.new_tokens, layout, k)
                    elif impl == "plain-jax":
                        row[impl] = run_plain_jax(model, prompts, args.new_tokens, args.static_len)
                    elif impl == "transformers":
                        row[impl] = run_transformers(config, prompts, args.new_tokens)
                except Exception as e:  # a failed comparator is reported, not hidden
                    row[impl] = dict(error=f"{type(e).__name__}: {e}"[:300])
                print(
                    f"{name} B={B} {impl}: {row[impl]} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
                save()
        data["memory"][name] = memory_rows(config, jnp.bfloat16)
        save()
        model.delete()
    return data


def report(data: dict, out: pathlib.Path) -> None:
    """Prints the tok/s and memory tables of a measured (or saved) run; writes out/generate.png.
    An implementation a row lacks (never run: a time limit) prints as "-", one that failed as
    "error"."""
    meta, rows, mem = data["meta"], data["rows"], data["memory"]
    impls = meta.get("impls") or [k for k in rows[0] if k not in ("model", "batch")]
    print(
        f"\ndecode tok/s, {meta['device']}, jax {meta['jax']}, tree {meta['commit']}, bf16 random "
        f"weights, prompt {meta['prompt']}, {meta['new_tokens']} new tokens, greedy; plain-jax "
        f"cache at {meta['static_len']} slots"
        + (f"; XLA_FLAGS={meta['xla_flags']}" if meta.get("xla_flags") else "")
    )
    ours = [i for i in impls if i.startswith("jax_kv-")]
    head = (
        f"| model | B | {' | '.join(impls)} | seq-major host us/call | host us/step "
        f"({', '.join(ours)}) | captures seq/head |"
    )
    print(head + "\n|" + "---|" * (head.count("|") - 1))

    def cell(r: dict, i: str) -> str:
        if i not in r:
            return "-"
        return f"{r[i]['tok_s']:,.0f}" if "tok_s" in r[i] else "error"

    for r in rows:
        seq, hm = r.get("jax_kv-seq", {}), r.get("jax_kv-head", {})
        per_step = " / ".join(
            f"{r[i]['host_overhead_us_per_step']:.0f}"
            if "host_overhead_us_per_step" in r.get(i, {})
            else "-"
            for i in ours
        )
        print(
            f"| {r['model']} | {r['batch']} | {' | '.join(cell(r, i) for i in impls)} | "
            f"{seq.get('host_overhead_us', float('nan')):.0f} | {per_step} | {seq.get('captures')}/"
            f"{hm.get('captures')} |"
        )
    print("\ncommitted KV bytes, seq-major VMM (B=1) vs a static cache of 32768 slots")
    print("| model | live | committed | static | static/committed |\n|---|---|---|---|---|")
    for name, mrows in mem.items():
        for m in mrows:
            print(
                f"| {name} | {m['live']} | {m['committed'] / 2**20:,.0f} MiB | "
                f"{m['static'] / 2**20:,.0f} MiB | {m['static'] / m['committed']:.1f}x |"
            )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        labels = [f"{r['model']}\nB={r['batch']}" for r in rows]
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [r.get(impl, {}).get("tok_s", 0.0) for r in rows]
            ax.bar(np.arange(len(rows)) + i * width, vals, width, label=impl)
        ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, labels, fontsize=7)
        ax.set_ylabel("decode tokens/s")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"decode tok/s, {meta['device']}, bf16, tree {meta['commit']}")
        fig.tight_layout()
        fig.savefig(out / "generate.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--static-len", type=int, default=4096)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument(
        "--report",
        type=pathlib.Path,
        help="print the tables and draw the PNG of a saved generate.json; measure nothing",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = json.loads(args.report.read_text()) if args.report else measure(args)
    report(data, args.out)


if __name__ == "__main__":
    main()
