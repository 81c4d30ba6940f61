"""Test setup: 8 simulated CPU devices (set before jax initialises), marker skipping.

On a GPU machine the same kernel tests run compiled (`INTERPRET` is False there).
"""

import os
import re
import tempfile

# On CPU machines (no NVIDIA device), XLA compiles without LLVM's optimisations: the
# tests' programs are small and mostly compiled once, so compiling dominates; a 2-core
# machine runs the suite about a fifth faster. GPU runs compile as users do.
FAST_COMPILE = (
    ""
    if os.path.exists("/dev/nvidiactl")
    else "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", FAST_COMPILE]
    ).strip()

# One persistent compilation cache for the test processes (both xdist workers and the
# trainer / profiler CLIs the tests start, which inherit the environment): a process
# that compiles a program another one compiled loads it instead. Entries are keyed by
# the program, jax's version, the flags and the devices, so a stale entry is never used.
# `JAX_ENABLE_COMPILATION_CACHE=false` turns it off; `JAX_COMPILATION_CACHE_DIR` moves it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"jflash-tests-jax-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import faulthandler  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# CPU computations run inline, not queued (set before the CPU client starts). Queued,
# the GPU interpreter deadlocked once on a loaded 2-core machine: in
# `test_mosaic_deterministic` the test's thread and an interpreted kernel's host
# callback were both blocked dispatching eager ops, most likely because the test's ops,
# queued behind the kernel, held the device's in-flight slots that the callback's own
# eager ops waited for. Inline, the test's thread cannot run ahead of the kernel.
jax.config.update("jax_cpu_enable_async_dispatch", False)

# A test that runs past TEST_TIMEOUT_S seconds (setup and teardown included) is a hang
# until shown otherwise (a kernel waiting on a barrier no one arrives at): its process
# prints every thread's stack and exits, so the run fails naming the test (pytest-xdist:
# "worker crashed while running ...") instead of waiting for CI's time limit. The
# slowest test takes about 35 s on a CPU, 60 s compiled on a GPU.
# `JFLASH_TEST_TIMEOUT_S=0` turns it off.
TEST_TIMEOUT_S = float(os.environ.get("JFLASH_TEST_TIMEOUT_S", "300"))
_hang_report = None  # where the stacks go: the stderr pytest's capture saved


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _hang_report
    if TEST_TIMEOUT_S <= 0:
        yield
        return
    if _hang_report is None:  # fd 2 itself is pytest's capture file, lost on exit
        capture = item.config.pluginmanager.getplugin("capturemanager")
        err = getattr(getattr(capture, "_global_capturing", None), "err", None)
        _hang_report = os.fdopen(os.dup(getattr(err, "targetfd_save", 2)), "w")
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=_hang_report)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
ON_HOPPER = ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"
# Tokens of the ring's one-device Mosaic cases (the only ones the GPU interpreter runs):
# 256 interpreted (two query tiles, about half the time of 512), 512 compiled.
MOSAIC_ONE_DEVICE_LEN = 256 if INTERPRET else 512


def cpu_devices(n: int) -> dict[str, str]:
    """Environment for a child process on `n` simulated CPU devices, on any machine."""
    flags = f"--xla_force_host_platform_device_count={n} {FAST_COMPILE}".strip()
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


# Mosaic kernels: compiled on sm90, the GPU interpreter on CPU, nothing on other GPUs.
needs_hopper = pytest.mark.skipif(
    ON_GPU and not ON_HOPPER, reason="compiled Mosaic GPU kernels need an sm90 GPU"
)


def quick_subset(cases, *aspects, ids=str):
    """`cases` as `pytest.param`s: the first case to show each value of each aspect
    (a function of the case) stays in the quick set (`make test-fast`); the others are
    marked `slow`, so `make test` still runs every case and the quick set still covers
    every value once."""
    seen, params = set(), []
    for case in cases:
        if isinstance(case, type(pytest.param(None))):  # a param of its own: kept as is
            params.append(pytest.param(*case.values, marks=case.marks, id=ids(case.values[0])))
            continue
        values = {(i, aspect(case)) for i, aspect in enumerate(aspects)}
        marks = () if values - seen else (pytest.mark.slow,)
        seen |= values
        params.append(pytest.param(case, marks=marks, id=ids(case)))
    return params


def pytest_collection_modifyitems(config, items):
    """Skips, with the reason: `gpu` tests on CPU; `multi_device(n)` tests where fewer
    than n devices exist (a GPU machine; CPU runs simulate 8)."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (compiled kernels); CPU runs interpret mode")
    count = jax.device_count()
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(no_gpu)
        marker = item.get_closest_marker("multi_device")
        if marker is None:
            continue
        if len(marker.args) != 1 or not isinstance(marker.args[0], int):
            raise pytest.UsageError(f"{item.nodeid}: write multi_device(n), n the devices it needs")
        if count < marker.args[0]:
            reason = f"needs {marker.args[0]} devices; {jax.device_count()=}"
            item.add_marker(pytest.mark.skip(reason=reason))


def run_oracle(script: str, *args, transformers_min: tuple[int, int] = (0, 0)) -> object:
    """``script`` run by the HF parity oracle's interpreter (``$JFLASH_ORACLE_PYTHON``,
    default ``.venv-oracle/bin/python``, as tests/test_models_parity.py finds it) with
    ``args``: the JSON its last line of output holds. Skips the test without the oracle
    (or its transformers or jinja2), or where its transformers is older than
    ``transformers_min`` (major, minor): behaviour that version brought."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = os.environ.get("JFLASH_ORACLE_PYTHON") or os.path.join(
        root, ".venv-oracle", "bin", "python"
    )
    if os.path.isabs(exe) and not os.path.isfile(exe):
        pytest.skip("no HF oracle interpreter (make oracle, or JFLASH_ORACLE_PYTHON)")
    probe = subprocess.run(
        [exe, "-c", "import transformers, jinja2; print(transformers.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode:
        pytest.skip(f"the oracle interpreter {exe} lacks transformers or jinja2")
    version = probe.stdout.strip().splitlines()[-1]
    release = re.match(r"(\d+)(?:\.(\d+))?", version)  # "5", "5.21", "5.21.0.dev0"
    have = (int(release[1]), int(release[2] or 0)) if release else None
    if transformers_min > (0, 0) and (have is None or have < transformers_min):
        need = ".".join(map(str, transformers_min))
        pytest.skip(f"the oracle's transformers is {version}; this needs {need} or later")
    result = subprocess.run(
        [exe, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def sighup_as_a_shell_gives_it():
    """SIGHUP's default action (the process ends) for the test and the processes it
    starts: a suite run under `nohup` inherits SIGHUP ignored, which the trainer and the
    tools rightly keep ignoring, so their SIGHUP handling could not be tested there."""
    import signal

    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, before)
