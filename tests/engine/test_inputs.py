"""StepInputs (jax_kv/engine/inputs.py): the Engine's per-step inputs, rewritten in place by a
small compiled call (donated, aliased): the values read back are the last written, the
addresses never change, and a write issued while a call that reads the arrays is pending does
not change what that call reads (the write is ordered after it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kv.engine.inputs import StepInputs

FIELDS = {"a": (3, np.int32), "b": (70, np.float32), "c": (5, np.uint32)}


def read(inputs, name):
    return np.asarray(jnp.copy(inputs[name]))


def test_written_values_are_read_back_at_the_same_address(rng):
    inputs = StepInputs(FIELDS)
    programs = inputs._write._cache_size()  # jit's cache of _update, every StepInputs' shapes
    try:
        first = {name: inputs[name].unsafe_buffer_pointer() for name in FIELDS}
        for name, (n, dtype) in FIELDS.items():  # zeros before any write
            np.testing.assert_array_equal(read(inputs, name), np.zeros((n,), dtype))
        for _ in range(3):
            values = {
                "a": rng.integers(-9, 9, 3),
                "b": rng.standard_normal(70),
                "c": rng.integers(0, 2**32, 5, dtype=np.uint64),
            }
            inputs.write(**values)
            for name, (n, dtype) in FIELDS.items():
                got = read(inputs, name)
                assert got.dtype == dtype and got.shape == (n,)
                np.testing.assert_array_equal(got, np.asarray(values[name], dtype))
        inputs.write(a=[7, 8, 9])  # one field: the others keep their values
        np.testing.assert_array_equal(read(inputs, "a"), [7, 8, 9])
        np.testing.assert_array_equal(read(inputs, "b"), np.asarray(values["b"], np.float32))
        np.testing.assert_array_equal(read(inputs, "c"), np.asarray(values["c"], np.uint32))
        moved = {name for name in FIELDS if inputs[name].unsafe_buffer_pointer() != first[name]}
        assert not moved, f"written at new addresses: {moved}"
        assert inputs.writes == 4
        inputs.write()  # nothing named: no compiled call
        assert inputs.writes == 4
        # No program past the constructor's: its first write and the later ones pass the packed
        # values the same way (a host array without a mesh), so no second jit signature.
        assert inputs._write._cache_size() == programs
    finally:
        inputs.close()
        inputs.close()  # idempotent


def test_a_write_is_ordered_after_the_calls_dispatched_before_it(rng):
    """The Engine writes call N+1's inputs while call N runs: N must read the old values."""
    inputs = StepInputs({"x": (256, np.float32)})
    slow = jax.jit(lambda x, m: (m @ m @ m @ m)[0, 0] * 0 + x)  # enough work to be pending
    try:
        old = rng.standard_normal(256).astype(np.float32)
        inputs.write(x=old)
        m = jnp.asarray(rng.standard_normal((1024, 1024)).astype(np.float32) / 32)
        pending = [slow(inputs["x"], m) for _ in range(3)]  # reads the array before the write
        new = rng.standard_normal(256).astype(np.float32)
        inputs.write(x=new)
        for p in pending:
            np.testing.assert_allclose(np.asarray(p), old, rtol=1e-6)
        np.testing.assert_array_equal(read(inputs, "x"), new)
    finally:
        inputs.close()


def test_replace_takes_an_aliased_output_as_the_field(rng):
    """The token picker's pattern: the field donated to a compiled call, its output (same
    address) taken back as the field."""
    inputs = StepInputs({"tokens": (4, np.int32)})
    pick = jax.jit(lambda logits, t: (jnp.where((p := logits.argmax(-1).astype(jnp.int32)) >= 0,
                                                 p, t), p), donate_argnums=(1,))  # fmt: skip
    try:
        before = inputs["tokens"].unsafe_buffer_pointer()
        logits = rng.standard_normal((4, 10)).astype(np.float32)
        field, picked = pick(logits, inputs["tokens"])
        inputs.replace("tokens", field)
        assert inputs["tokens"].unsafe_buffer_pointer() == before
        np.testing.assert_array_equal(read(inputs, "tokens"), logits.argmax(-1))
        np.testing.assert_array_equal(np.asarray(picked), logits.argmax(-1))
    finally:
        inputs.close()


def test_a_wrong_length_or_dtype_is_refused_by_name():
    inputs = StepInputs(FIELDS)
    try:
        with pytest.raises(ValueError, match=r"b: expected shape \(70,\), got \(69,\)"):
            inputs.write(b=np.zeros(69))
        with pytest.raises(ValueError, match=r"d: not one of the inputs \['a', 'b', 'c'\]"):
            inputs.write(d=[1])
        assert inputs.writes == 0  # nothing was written
    finally:
        inputs.close()
    with pytest.raises(ValueError, match="e: expected a 4-byte dtype, got int64"):
        StepInputs({"e": (2, np.int64)})
