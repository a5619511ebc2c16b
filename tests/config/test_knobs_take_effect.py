"""Every JAX_KV_* knob changes what it says it changes (issue 20, item 6). Each case runs in
its own process: the config is read once per process and frozen."""

import pytest
from processes import run

from jax_kv.config import variables

CASES = {
    # knob: (value, code printing the value it governs, what it must print)
    "JAX_KV_MIN_BUCKET": (
        "32",
        "import jax_kv.models as jm; from jax_kv import Generator\n"
        "g = Generator(jm.random_model('tiny-llama')); print(g.min_bucket)\n"
        "from jax_kv.cli import _parser\n"
        "print(_parser().parse_args(['generate']).min_bucket)\n"
        "from jax_kv.cache import KvCache\n"
        "print(KvCache(num_layers=1, batch=1, num_kv_heads=1, head_dim=64).capacity)",
        "32\nNone\n32",  # the CLI passes None: the Generator's default, the knob
    ),
    "JAX_KV_ARENA": (
        "vmm",
        "from jax_kv.cache import KvCache\n"
        "try:\n    KvCache(num_layers=1, batch=1, num_kv_heads=1, head_dim=64)\n"
        "except Exception as e:\n    print(type(e).__name__)",
        "RuntimeError",  # a VmmArena on a machine without CUDA: the choice was honoured
    ),
    "JAX_KV_RESERVE_BYTES": (
        "3G",
        "from jax_kv.memory import HostDriver, VmmArena\n"
        "print(VmmArena(driver=HostDriver(granule=1 << 16)).reserved_bytes)",
        str(3 << 30),
    ),
    "JAX_KV_COMMIT_AHEAD": (
        "100",
        "from jax_kv.cache import KvCache; from jax_kv.memory import host_arena\n"
        "c = KvCache(num_layers=1, batch=1, num_kv_heads=1, head_dim=64, max_len=4096,\n"
        "            arena=host_arena(granule=1 << 16))\n"
        "print(c.commit_step, c.capacity, c.ensure_capacity(101).new_capacity)",
        "100 100 200",
    ),
    "JAX_KV_EXCESS_PRECISION": (
        "1",
        # A bf16 product rounds to bf16 before its float32 use, as the program says, unless
        # XLA may keep it in float32 (the steps' compile options): rows that differ from the
        # per-op rounding.
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from jax_kv.config import step_compiler_options\n"
        "x = jnp.asarray(np.random.default_rng(0).standard_normal(256), jnp.float32)\n"
        "f = lambda x: (x.astype(jnp.bfloat16) * jnp.bfloat16(3)).astype(jnp.float32) + 1\n"
        "got = jax.jit(f, compiler_options=step_compiler_options())(x)\n"
        "xb = np.asarray(x.astype(jnp.bfloat16)).astype(np.float32)\n"
        "ref = np.asarray(jnp.asarray(xb * 3).astype(jnp.bfloat16)).astype(np.float32) + 1\n"
        "print(bool((np.asarray(got) != ref).any()))",
        "True",
    ),
    "JAX_KV_BATCH_INVARIANT": (
        "1",
        # The three things the mode changes: the steps' GEMM options, a one-row matmul
        # computed as two rows, and the decode kernel's fixed split count (an attribute of
        # the compiled call, which the CPU handler ignores).
        "import re, jax, jax.numpy as jnp\n"
        "from jax_kv import Layout, gqa_decode\n"
        "from jax_kv.config import step_compiler_options\n"
        "from jax_kv.models.projection import matmul_rows\n"
        "o = step_compiler_options()\n"
        "print(o.get('xla_gpu_enable_triton_gemm'), o.get('xla_gpu_autotune_level'))\n"
        "hlo = jax.jit(matmul_rows).lower(jnp.ones((1, 8)), jnp.ones((4, 8))).as_text()\n"
        "print(re.findall(r'dot_general.*-> tensor<(\\w+)>', hlo))\n"
        "q, kv, c = jnp.ones((1, 2, 64)), jnp.ones((1, 1, 64)), jnp.ones((1, 8, 1, 64))\n"
        "f = lambda *a: gqa_decode(*a, layout=Layout.SEQ_MAJOR)\n"
        "hlo = jax.jit(f).lower(q, kv, kv, c, c, jnp.zeros((1,), jnp.int32)).as_text()\n"
        "print(re.findall(r'splits = (\\d+) : i32', hlo))",
        "False 0\n['2x4xf32']\n['16']",
    ),
    "JAX_KV_POOL_BYTES": (
        "256K",
        "from jax_kv.memory import HostDriver, VmmArena\n"
        "a = VmmArena(driver=HostDriver(granule=1 << 16), reserve_bytes=1 << 30)\n"
        "print(a.pool_target, a.refill_pool())",
        f"{256 << 10} 4",
    ),
}


@pytest.mark.parametrize("knob", sorted(CASES))
def test_knob_takes_effect(knob):
    value, code, want = CASES[knob]
    r = run(code, **{knob: value})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == want, (knob, r.stdout, r.stderr[-1000:])
    default = run(code)  # and without it, something else: the knob made the difference
    assert default.stdout.strip() != want, (knob, default.stdout, default.stderr[-1000:])


def test_every_knob_is_covered():
    assert set(CASES) == set(variables())
