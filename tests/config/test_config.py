"""RuntimeConfig: JAX_KV_* read once, validated, frozen; a change after the freeze is an error
naming the variable. Each case runs in its own process, as config-dependent tests must."""

import pytest
from processes import run

from jax_kv.config import ConfigError, RuntimeConfig, from_env, variables


def test_defaults():
    assert from_env({}) == RuntimeConfig()
    assert RuntimeConfig().min_bucket == 256


def test_parses_each_variable():
    env = {
        "JAX_KV_MIN_BUCKET": "64",
        "JAX_KV_ARENA": "Eager",
        "JAX_KV_RESERVE_BYTES": "64G",
        "JAX_KV_COMMIT_AHEAD": "128",
        "JAX_KV_POOL_BYTES": "0",
        "JAX_KV_EXCESS_PRECISION": "1",
        "JAX_KV_BATCH_INVARIANT": "true",
    }
    assert set(env) == set(variables())
    assert from_env(env) == RuntimeConfig(64, "eager", 64 << 30, 128, 0, True, True)


@pytest.mark.parametrize(
    "name, raw",
    [
        ("JAX_KV_MIN_BUCKET", "100"),
        ("JAX_KV_MIN_BUCKET", "abc"),
        ("JAX_KV_ARENA", "cuda"),
        ("JAX_KV_RESERVE_BYTES", "-1"),
        ("JAX_KV_RESERVE_BYTES", "12X"),
        ("JAX_KV_COMMIT_AHEAD", "0"),
        ("JAX_KV_EXCESS_PRECISION", "yes"),
        ("JAX_KV_BATCH_INVARIANT", "on"),
    ],
)
def test_invalid_value_names_the_variable(name, raw):
    with pytest.raises(ConfigError, match=name):
        from_env({name: raw})


@pytest.mark.parametrize("name", ["JAX_KV_DECODE_KERNEL", "JAX_KV_PREFILL_KERNEL"])
def test_removed_kernel_variables_are_refused_not_ignored(name):
    # Issue 20: the CUDA kernel a call runs is a function of the call. A shell that still sets
    # the old variable gets an error naming it, not a knob that silently does nothing.
    assert name not in variables()
    with pytest.raises(ConfigError, match=f"{name} was removed"):
        from_env({name: "2"})
    assert from_env({name: ""}) == RuntimeConfig()


def test_change_after_freeze_raises_naming_variable_and_values():
    r = run(
        """
        import os
        from jax_kv.config import runtime_config, ConfigChangedError
        assert runtime_config().min_bucket == 64
        assert runtime_config().min_bucket == 64  # unchanged: fine
        os.environ["JAX_KV_MIN_BUCKET"] = "32"
        try:
            runtime_config()
        except ConfigChangedError as e:
            print("ERR", e)
        """,
        JAX_KV_MIN_BUCKET="64",
    )
    assert r.returncode == 0, r.stderr
    assert "ERR JAX_KV_MIN_BUCKET" in r.stdout
    assert "frozen value '64'" in r.stdout and "current value '32'" in r.stdout


def test_newly_set_variable_after_freeze_raises():
    r = run(
        """
        import os
        from jax_kv.config import runtime_config, ConfigChangedError
        runtime_config()
        os.environ["JAX_KV_ARENA"] = "eager"
        try:
            runtime_config()
        except ConfigChangedError as e:
            print("ERR", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "ERR JAX_KV_ARENA" in r.stdout and "frozen value None" in r.stdout


def test_env_feeds_cache_and_explicit_argument_wins():
    r = run(
        """
        import jax.numpy as jnp
        from jax_kv.cache import KvCache
        kw = dict(num_layers=1, batch=1, num_kv_heads=1, head_dim=64, dtype=jnp.float32)
        a = KvCache(**kw)
        b = KvCache(**kw, min_bucket=16)
        print(type(a.arena).__name__, a.capacity, b.capacity)
        """,
        JAX_KV_MIN_BUCKET="32",
        JAX_KV_ARENA="eager",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["EagerArena", "32", "16"]


def test_invalid_env_fails_at_first_read():
    r = run(
        """
        from jax_kv.config import runtime_config
        runtime_config()
        """,
        JAX_KV_ARENA="gpu",
    )
    assert r.returncode != 0 and "JAX_KV_ARENA: expected vmm, eager or auto" in r.stderr
