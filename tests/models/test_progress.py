"""The load progress line: drawn when asked (or on a terminal after 1 s), never into a log."""

from jax_kv.models.loading import _Progress


def test_progress_drawn_when_enabled(capsys):
    p = _Progress("jax_kv: loading x", total=4 << 20, enabled=True)
    p.update(2 << 20)
    p.update(2 << 20)
    p.close()
    err = capsys.readouterr().err
    assert "100.0% 4/4 MiB" in err and err.endswith("\n")


def test_progress_silent_when_not_a_terminal(capsys):
    p = _Progress("jax_kv: loading x", total=1 << 20, enabled=None)
    p.start -= 5.0  # as if the load had run for 5 s
    p.update(1 << 20)
    p.close()
    assert capsys.readouterr().err == ""
