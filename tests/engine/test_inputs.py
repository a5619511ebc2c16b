"""StepInputs (jax_kv/engine/inputs.py): the Engine's per-step inputs, at fixed addresses on a
VMM arena (views rewritten in place), fresh uploads elsewhere; the values read back are the
last written either way."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kv.engine.inputs import StepInputs
from jax_kv.memory import EagerArena, host_arena

FIELDS = {"a": (3, np.int32), "b": (70, np.float32), "c": (5, np.uint32)}


@pytest.fixture(params=["host", "eager"])
def arena(request):
    if request.param == "eager":
        yield EagerArena()
        return
    a = host_arena(reserve_bytes=64 << 20, granule=64 << 10)
    yield a
    assert a.committed_bytes == 0  # the inputs' region was freed
    a.close()


def test_written_values_are_read_back_at_the_same_address(arena, rng):
    inputs = StepInputs(FIELDS, arena)
    try:
        first = {name: inputs[name].unsafe_buffer_pointer() for name in FIELDS}
        for _ in range(3):
            values = {
                "a": rng.integers(-9, 9, 3),
                "b": rng.standard_normal(70),
                "c": rng.integers(0, 2**32, 5, dtype=np.uint64),
            }
            inputs.write(**values)
            for name, (n, dtype) in FIELDS.items():
                got = np.asarray(jnp.copy(inputs[name]))  # not np.asarray's cached snapshot
                assert got.dtype == dtype and got.shape == (n,)
                np.testing.assert_array_equal(got, np.asarray(values[name], dtype))
        inputs.write(a=[7, 8, 9])  # one field: the others keep their values
        np.testing.assert_array_equal(np.asarray(jnp.copy(inputs["a"])), [7, 8, 9])
        np.testing.assert_array_equal(
            np.asarray(jnp.copy(inputs["c"])), np.asarray(values["c"], np.uint32)
        )
        moved = {name for name in FIELDS if inputs[name].unsafe_buffer_pointer() != first[name]}
        assert moved == (set() if inputs.fixed else set(FIELDS))
        if inputs.fixed:  # views of one region: each 256-byte aligned, as every view is
            assert all(inputs[name].unsafe_buffer_pointer() % 256 == 0 for name in FIELDS)
    finally:
        inputs.close()
        inputs.close()  # idempotent


def test_a_wrong_length_is_refused_by_name(arena):
    inputs = StepInputs(FIELDS, arena)
    try:
        with pytest.raises(ValueError, match=r"b: expected shape \(70,\), got \(69,\)"):
            inputs.write(b=np.zeros(69))
        with pytest.raises(ValueError, match=r"d: not one of the inputs \['a', 'b', 'c'\]"):
            inputs.write(d=[1])
    finally:
        inputs.close()
