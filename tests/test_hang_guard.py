"""The per-test time limit in `tests/conftest.py`: a test that hangs fails, naming itself."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pytest(tmp_path, *args, limit_s):
    """A child pytest run of one sleeping test with this suite's conftest as a plugin."""
    test = tmp_path / "test_sleeps.py"
    test.write_text(
        textwrap.dedent("""
        import time

        def test_sleeps_past_the_limit():
            time.sleep(60)
    """)
    )
    env = dict(os.environ, JFLASH_TEST_TIMEOUT_S=str(limit_s), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    cmd += ["-c", os.devnull, "--rootdir", str(tmp_path), *args, str(test)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_a_hanging_test_fails_with_its_stack(tmp_path):
    run = _pytest(tmp_path, limit_s=3)
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "Timeout (0:00:03)!" in out, out[-2000:]
    assert "in test_sleeps_past_the_limit" in out, out[-2000:]


def test_a_hanging_test_under_xdist_names_itself(tmp_path):
    run = _pytest(tmp_path, "-n", "1", limit_s=3)
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "crashed while running" in out and "test_sleeps_past_the_limit" in out, out[-2000:]
