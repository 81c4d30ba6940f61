"""SIGTERM (a scheduler preempting the job) while `python -m train` trains: the step it
reached is saved, and a resume continues it as if nothing had happened."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import ON_GPU, cpu_devices

from train import loop, outputs
from train.checkpoint import Checkpoints
from train.config import parse_args
from train.errors import Preempted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10
TINY = [
    "--model_name_or_path",
    "tiny",
    "--data_path",
    "sample",
    "--model_max_length",
    "64",
    "--sample_num_examples",
    "24",
    "--attention",
    "xla",
    "--learning_rate",
    "3e-3",
    "--max_steps",
    str(STEPS),
    "--save_steps",
    "100",  # no regular save before the end: only the preemption's
    "--logging_steps",
    "1",
    "--progress",
    "false",
    "--export_hf",
    "false",
    "--report_to",
    "none",
]
# `python -m train` with each step's metrics fetched 0.25 s late: steps slow enough to
# signal the run mid-way, whatever the machine.
SLOW_STEPS = (
    "import runpy, sys, time; import train.loop as loop; finish = loop._finish; "
    "loop._finish = lambda *a, **k: (time.sleep(0.25), finish(*a, **k))[1]; "
    "sys.argv = ['train', *sys.argv[1:]]; runpy.run_module('train', run_name='__main__')"
)


def _env(devices: int = 1, **extra) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT, **cpu_devices(devices), **extra)


def _train(out, *extra, slow=False, env=None) -> subprocess.Popen:
    start = ["-c", SLOW_STEPS] if slow else ["-m", "train"]
    return subprocess.Popen(
        [sys.executable, *start, *TINY, "--output_dir", str(out), *extra],
        env=env or _env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _losses(out) -> dict[int, float]:
    with open(os.path.join(out, "log.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _terminate_after_step(proc: subprocess.Popen, out, step: int = 3) -> tuple[str, str]:
    """SIGTERM to `proc` once its log holds `step`; its `(stdout, stderr)`."""
    log, deadline = os.path.join(out, "log.jsonl"), time.monotonic() + 120
    while not (os.path.exists(log) and step in _losses(out)):
        if proc.poll() is not None:
            pytest.fail(f"the run ended before step {step}: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"no step {step} in 120 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=120)


def _sigterm_after(finish, step: int, signum: int = signal.SIGTERM):
    """`loop._finish` that sends this process SIGTERM (or `signum`) once step `step`'s
    record is made (in process: while the step's metrics are fetched)."""

    def finish_then_sigterm(pending, *args):
        record = finish(pending, *args)
        if record["step"] == step:
            signal.raise_signal(signum)
        return record

    return finish_then_sigterm


def test_sigterm_in_the_loop_saves_the_step_in_flight(tmp_path, monkeypatch, capsys):
    """In process: a SIGTERM while step 3's metrics are fetched stops the loop after
    step 3, saved as a regular save is (its step and data position), complete on disk;
    the handler from before the run is back. The stop is timed, from the signal to the
    closed checkpoints, in one line whose parts add up."""
    finish = loop._finish
    finish_then_sigterm = _sigterm_after(finish, 3)

    def before(signum, frame):
        raise AssertionError("the run's own SIGTERM handler was not in place")

    monkeypatch.setattr(loop, "_finish", finish_then_sigterm)
    out = tmp_path / "run"
    previous = signal.signal(signal.SIGTERM, before)
    try:
        with pytest.raises(Preempted) as stopped:
            loop.run(parse_args([*TINY, "--output_dir", str(out)]))
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (stopped.value.step, stopped.value.saved) == (3, True)
    assert stopped.value.directory == str(out / "checkpoints")
    assert os.listdir(out / "checkpoints") == ["3"] and max(_losses(out)) == 3
    saved = Checkpoints(str(out), None, read_only=True)
    try:
        meta = saved.meta(3)
    finally:
        saved.close()
    epoch, index = divmod(3, 24 // meta["run"]["rows_per_step"])  # 24 rows, a batch a step
    assert meta["step"] == 3 and meta["data"] == {"epoch": epoch, "index": index}
    assert meta["run"]["total_steps"] == STEPS

    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("SIGTERM at")]
    said = re.fullmatch(
        r"SIGTERM at step 3: saved (\d+\.\d) s after the signal \(the step's end (\d+\.\d) s, "
        r"the save in flight (\d+\.\d) s, step 3's save (\d+\.\d) s\); closing took "
        r"(\d+\.\d) s more",
        line,
    )
    assert said, line
    total, *parts, _ = map(float, said.groups())
    assert parts[2] > 0 and sum(parts) == pytest.approx(total, abs=0.25)  # rounded each


def test_sigterm_in_a_traced_window_says_which_steps_were_traced(tmp_path, monkeypatch, capsys):
    """A SIGTERM inside the --profile_steps window keeps the steps traced so far, and a
    line says which (the trace tool reads that trace as the newest)."""
    monkeypatch.setattr(loop, "_finish", _sigterm_after(loop._finish, 3))
    out = tmp_path / "run"
    with pytest.raises(Preempted):
        loop.run(parse_args([*TINY, "--output_dir", str(out), "--profile_steps", "2,6"]))
    assert (
        f"--profile_steps: the run stopped in the window: traced steps 2..3 into "
        f"{out / 'tensorboard'}\n"
    ) in capsys.readouterr().out
    assert list((out / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))


# Three runs of `python -m train`, two at once: about 15 s on two cores.
@pytest.mark.slow
def test_sigterm_saves_the_step_reached_and_a_resume_matches_an_uninterrupted_run(tmp_path):
    """SIGTERM mid-run (no checkpoint since the start): the step in flight finishes and
    is saved, with status 143 and one line naming it; a resume from it reaches every
    loss of an uninterrupted run (the saved data position is right)."""
    out, whole = tmp_path / "run", tmp_path / "whole"
    reference = _train(whole)  # meanwhile
    stdout, stderr = _terminate_after_step(_train(out, slow=True), out)
    assert reference.wait(timeout=120) == 0, reference.communicate()[1][-3000:]
    assert "Traceback" not in stderr, stderr
    (step, where) = re.findall(
        r"SIGTERM: saved a checkpoint at step (\d+) in (\S+); resume with "
        r"--resume_from_checkpoint latest",
        stderr,
    )[0]
    step = int(step)
    assert where == str(out / "checkpoints")
    assert 3 <= step < STEPS, stderr
    # The step saved is the last one logged, and it is whole (no orbax temporary left).
    assert max(_losses(out)) == step
    assert os.listdir(out / "checkpoints") == [str(step)]
    assert outputs.saved_steps(out) == [step]

    resumed = _train(out, "--resume_from_checkpoint", "latest")
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr[-3000:]
    assert f"resumed from step {step} of {out}" in stdout
    assert _losses(out) == _losses(whole)


@pytest.mark.parametrize(
    "flags", [["--save_on_preemption", "false"], ["--save_strategy", "no"]], ids=str
)
def test_sigterm_without_a_preemption_save_stops_saving_nothing(tmp_path, flags):
    """`--save_on_preemption false`, or `--save_strategy no` (no checkpoints asked for):
    SIGTERM stops the run at once, status 143, saying no checkpoint was written."""
    out = tmp_path / "run"
    proc = _train(out, *flags, slow=True)
    _, stderr = _terminate_after_step(proc, out)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    assert f"terminated (SIGTERM): no checkpoint was written to {out / 'checkpoints'}" in stderr
    assert "SIGTERM: saved" not in stderr
    assert outputs.saved_steps(out) == []
    assert max(_losses(out)) < STEPS


@pytest.mark.slow
def test_two_processes_save_the_same_step_after_a_sigterm_to_one(tmp_path):
    """Two processes (jax.distributed, its preemption service): a SIGTERM to process 1
    alone stops both at the same step, which both save together, each with status 143
    and the line naming it."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = _env(2, JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    out = tmp_path / "run"
    procs = [
        _train(
            out,
            "--mesh",
            "data=1,fsdp=-1,seq=1",
            "--coordinator_address",
            f"localhost:{port}",
            "--num_processes",
            "2",
            "--process_id",
            str(i),
            slow=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        _, stderr1 = _terminate_after_step(procs[1], out)
        _, stderr0 = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
    lines = []
    for p, err in zip(procs, (stderr0, stderr1), strict=True):
        assert p.returncode == 143, err[-3000:]
        lines.append(re.findall(r"SIGTERM: saved a checkpoint at step (\d+) in (\S+);", err))
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    step = int(lines[0][0][0])
    assert 3 <= step < STEPS
    assert outputs.saved_steps(out) == [step] and max(_losses(out)) == step


def test_auto_resume_starts_a_job_and_continues_it(tmp_path, monkeypatch, capsys):
    """`--resume_from_checkpoint auto`, one command for a job's first start and its
    requeue: from the start where `--output_dir` holds no checkpoint (saying so), from
    its latest where it does, `--overwrite_output_dir` then ignored rather than
    deleting them; the log ends holding every step once."""
    finish = loop._finish
    finish_then_sigterm = _sigterm_after(finish, 3)

    out = tmp_path / "job"
    argv = [*TINY, "--output_dir", str(out), "--resume_from_checkpoint", "auto"]
    monkeypatch.setattr(loop, "_finish", finish_then_sigterm)
    with pytest.raises(Preempted):
        loop.run(parse_args(argv))
    said = capsys.readouterr().out
    assert f"--resume_from_checkpoint auto: no checkpoint in {out / 'checkpoints'}" in said
    assert os.listdir(out / "checkpoints") == ["3"]
    monkeypatch.setattr(loop, "_finish", finish)
    summary = loop.run(parse_args([*argv, "--overwrite_output_dir", "true"]))
    assert summary["start_step"] == 3
    assert f"resumed from step 3 of {out}" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))


def test_a_sigterm_on_the_last_step_then_the_requeue_writes_the_export(
    tmp_path, monkeypatch, capsys
):
    """A SIGTERM during the last step saves it and stops before the HF export; the
    requeued command (`auto`) finds the run done, and writes the export an uninterrupted
    run writes, byte for byte."""
    finish = loop._finish
    out = tmp_path / "job"
    argv = [*TINY, "--output_dir", str(out), "--resume_from_checkpoint", "auto"]
    argv += ["--export_hf", "true"]
    monkeypatch.setattr(loop, "_finish", _sigterm_after(finish, STEPS))
    with pytest.raises(Preempted):
        loop.run(parse_args(argv))
    assert os.listdir(out / "checkpoints") == [str(STEPS)]
    assert not outputs.has_export(str(out))
    monkeypatch.setattr(loop, "_finish", finish)
    capsys.readouterr()
    summary = loop.run(parse_args(argv))
    assert (summary["start_step"], summary["losses"]) == (STEPS, [])
    said = capsys.readouterr()
    assert f"checkpoint {STEPS} has no HF export" in said.out, said
    assert outputs.has_export(str(out))
    whole = tmp_path / "whole"
    loop.run(parse_args([*TINY, "--output_dir", str(whole), "--export_hf", "true"]))

    def files(d):
        return {p.name: p.read_bytes() for p in (d / "hf").iterdir()}

    if not ON_GPU:
        assert files(out) == files(whole)
    else:
        # Two GPU runs of one job differ unless XLA runs deterministic ops (atomic adds,
        # XLA's scatters), and Adam's steps magnify that where a gradient is near zero:
        # on an H200 after 10 steps, up to 0.43% of a tensor's norm (the embedding) and
        # 11% of its largest entry, where the export of step 1 is 15-31% of each
        # matrix's norm away. The same files, each tensor within 1% of its norm.
        from safetensors.numpy import load_file

        ours, theirs = files(out), files(whole)
        assert ours.keys() == theirs.keys()
        for name in ours:
            if name.endswith(".safetensors"):
                a, b = load_file(out / "hf" / name), load_file(whole / "hf" / name)
                assert a.keys() == b.keys()
                for key in a:
                    gap = np.linalg.norm(a[key] - b[key]) / np.linalg.norm(b[key])
                    assert gap <= 1e-2, (name, key, gap)
            else:
                assert ours[name] == theirs[name], name
    # Run again, the export whole: nothing is written.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    loop.run(parse_args(argv))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_a_second_sigterm_or_a_ctrl_c_during_the_preemption_save_is_dropped(tmp_path, monkeypatch):
    """SIGTERM then, while its save is being written, another SIGTERM and a Ctrl-C: the
    save completes, the run stops as one preempted once (no KeyboardInterrupt), and the
    checkpoint reads back whole."""
    monkeypatch.setattr(loop, "_finish", _sigterm_after(loop._finish, 3))
    save = loop.Checkpoints.save
    seen = []

    def save_under_signals(self, step, state, meta, **kwargs):
        seen.append(step)
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        return save(self, step, state, meta, **kwargs)

    monkeypatch.setattr(loop.Checkpoints, "save", save_under_signals)
    out = tmp_path / "run"
    with pytest.raises(Preempted) as stopped:
        loop.run(parse_args([*TINY, "--output_dir", str(out)]))
    assert (stopped.value.step, stopped.value.saved, seen) == (3, True, [3])
    saved = Checkpoints(str(out), None, read_only=True)
    try:
        assert saved.meta(3)["step"] == 3
    finally:
        saved.close()


def _sigterm_in_the_first_evaluation(monkeypatch) -> list:
    """A SIGTERM raised as the run's first evaluation makes its first batch; returns
    the list each evaluation appends to (append to it to stop further SIGTERMs)."""
    from train import build

    batches, evaluate = build.Trainer.eval_batches, loop._evaluate
    evaluations = []

    def counted(*args, **kwargs):
        evaluations.append(True)
        return evaluate(*args, **kwargs)

    def sigterm_in_the_first(self):
        for batch in batches(self):
            if len(evaluations) == 1:  # the first evaluation, as its first batch is made
                signal.raise_signal(signal.SIGTERM)
            yield batch

    monkeypatch.setattr(loop, "_evaluate", counted)
    monkeypatch.setattr(build.Trainer, "eval_batches", sigterm_in_the_first)
    return evaluations


@pytest.mark.parametrize("when", ["on_start", "mid_run"])
def test_a_sigterm_during_an_evaluation_does_not_hold_the_save(tmp_path, monkeypatch, capsys, when):
    """A SIGTERM while the validation set is evaluated does not wait for the evaluation
    (a long one would outlast a preemption's grace period). `--eval_on_start`'s stops
    the run as a SIGTERM before the first step does (nothing trained, nothing saved;
    its restart evaluates again); a step's is left unfinished and unlogged, the step
    saved with a note of it, and the resume evaluates that step first."""
    from train.errors import Terminated, signals_as_interrupts

    evaluations = _sigterm_in_the_first_evaluation(monkeypatch)
    out = tmp_path / "run"
    flags = ["--eval_data_path", "sample", "--eval_strategy", "steps", "--eval_steps", "2"]
    flags += ["--per_device_train_batch_size", "1", "--output_dir", str(out)]
    if when == "on_start":
        with signals_as_interrupts(), pytest.raises(Terminated):  # as `python -m train`
            loop.run(parse_args([*TINY, *flags, "--eval_on_start", "true"]))
        assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints")
        with open(out / "log.jsonl") as f:
            assert f.read() == ""
        return
    with pytest.raises(Preempted) as stopped:
        loop.run(parse_args([*TINY, *flags]))
    assert (stopped.value.step, stopped.value.saved) == (2, True)
    assert os.listdir(out / "checkpoints") == ["2"]
    with open(out / "log.jsonl") as f:
        assert not [r for r in map(json.loads, f) if "eval_loss" in r]
    assert "SIGTERM during the evaluation at step 2: left unfinished" in capsys.readouterr().out
    saved = Checkpoints(str(out), None, read_only=True)
    try:
        assert saved.meta(2)[loop.EVAL_PENDING] is True
    finally:
        saved.close()
    evaluations.append(True)  # no more SIGTERMs
    loop.run(parse_args([*TINY, *flags, "--resume_from_checkpoint", "latest"]))
    with open(out / "log.jsonl") as f:
        records = [r for r in map(json.loads, f)]
    steps = [(r["step"], "eval_loss" in r) for r in records]
    assert steps[:3] == [(1, False), (2, False), (2, True)], steps  # step 2's, then step 3
    assert steps[3] == (3, False)


def test_a_sigterm_during_the_last_steps_evaluation_is_evaluated_on_resume(
    tmp_path, monkeypatch, capsys
):
    """The evaluation of the run's last step cut short by a SIGTERM: the resume finds
    nothing to train, evaluates that step (where it used to say "nothing to train" and
    lose it), and a resume after that does not evaluate it twice."""
    evaluations = _sigterm_in_the_first_evaluation(monkeypatch)
    out = tmp_path / "run"
    flags = ["--eval_data_path", "sample", "--eval_strategy", "steps", "--eval_steps"]
    flags += [str(STEPS), "--per_device_train_batch_size", "1", "--output_dir", str(out)]
    with pytest.raises(Preempted) as stopped:
        loop.run(parse_args([*TINY, *flags]))
    assert (stopped.value.step, stopped.value.saved) == (STEPS, True)
    assert f"SIGTERM during the evaluation at step {STEPS}: left unfinished" in (
        capsys.readouterr().out
    )
    evaluations.append(True)  # no more SIGTERMs
    # Resumed into another directory, the finished run writes nothing there.
    elsewhere = [*TINY, *flags, "--resume_from_checkpoint", str(out)]
    loop.run(parse_args([*elsewhere, "--output_dir", str(tmp_path / "other")]))
    assert "nothing is written into" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    resume = [*TINY, *flags, "--resume_from_checkpoint", "latest"]
    for said in (": evaluating it, which a stop cut short", ""):
        loop.run(parse_args(resume))
        err = capsys.readouterr().err
        assert f"nothing to train: checkpoint {STEPS} is already at the run's" in err
        assert err.split(f"{STEPS} steps", 1)[1].startswith(said + "\n"), err
        with open(out / "log.jsonl") as f:
            evals = [r["step"] for r in map(json.loads, f) if "eval_loss" in r]
        assert evals == [STEPS]


def test_a_sigterm_before_an_overwrite_runs_first_checkpoint_keeps_both_runs(
    tmp_path, monkeypatch, capsys
):
    """SIGTERM to an `--overwrite_output_dir` run before its first checkpoint: the step
    reached is saved (the job is to go on) and the run it replaces stays, byte for byte,
    in previous_run/ (a mistaken overwrite stopped by a kill loses nothing), saying
    both; the resume continues the new run and deletes previous_run/ once it has a
    checkpoint of its own."""
    out = tmp_path / "run"
    loop.run(parse_args([*TINY, "--output_dir", str(out)]))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    monkeypatch.setattr(loop, "_finish", _sigterm_after(loop._finish, 3))
    again = [*TINY, "--output_dir", str(out), "--learning_rate", "1e-3"]
    with pytest.raises(Preempted) as stopped:
        loop.run(parse_args([*again, "--overwrite_output_dir", "true"]))
    assert (stopped.value.step, stopped.value.saved) == (3, True)
    aside = out / outputs.PREVIOUS_RUN
    kept = {
        p.relative_to(aside): p.read_bytes()
        for p in aside.rglob("*")
        if p.is_file() and p.name != outputs.MOVES
    }
    assert kept == before
    assert outputs.saved_steps(out) == [3]
    said = capsys.readouterr().err
    assert f"the run this one replaces is kept in {aside} beside this run's checkpoint 3" in said
    monkeypatch.undo()
    loop.run(parse_args([*again, "--resume_from_checkpoint", "latest"]))
    assert not aside.exists() and outputs.saved_steps(out) == [3, STEPS]
    assert "deleted the run it replaces" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["in process", "python -m train"])
def test_sighup_saves_the_step_reached_as_sigterm_does(
    tmp_path, monkeypatch, how, sighup_as_a_shell_gives_it
):
    """SIGHUP (a terminal closed, an ssh session dropped) while the run trains: the step
    reached is saved as on SIGTERM, and the run ends with SIGHUP's status, 129, and a
    line naming it; under `nohup` (SIGHUP ignored) the run goes on."""
    out = tmp_path / "run"
    if how == "in process":
        monkeypatch.setattr(loop, "_finish", _sigterm_after(loop._finish, 3, signal.SIGHUP))
        with pytest.raises(Preempted) as stopped:
            loop.run(parse_args([*TINY, "--output_dir", str(out)]))
        assert (stopped.value.step, stopped.value.saved) == (3, True)
        assert stopped.value.line().startswith("SIGHUP: saved a checkpoint at step 3 in ")
        assert outputs.saved_steps(out) == [3]
        return
    proc = _train(out, slow=True)
    log, deadline = out / "log.jsonl", time.monotonic() + 120
    while not (log.exists() and 3 in _losses(out)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 129, stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    (step,) = re.findall(r"SIGHUP: saved a checkpoint at step (\d+) in ", stderr)
    assert outputs.saved_steps(out) == [int(step)] and max(_losses(out)) == int(step)

    ignored = tmp_path / "nohup"
    nohup = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys, runpy; signal.signal(signal.SIGHUP, "
         "signal.SIG_IGN); sys.argv = ['train', *sys.argv[1:]]; "
         "runpy.run_module('train', run_name='__main__')",
         *TINY, "--output_dir", str(ignored)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    while not ((ignored / "log.jsonl").exists() and 1 in _losses(ignored)):
        assert nohup.poll() is None and time.monotonic() < deadline + 120
        time.sleep(0.02)
    nohup.send_signal(signal.SIGHUP)
    _, stderr = nohup.communicate(timeout=120)
    assert nohup.returncode == 0, stderr[-3000:]
    assert max(_losses(ignored)) == STEPS


def test_a_closed_terminal_saves_the_step_reached(tmp_path, sighup_as_a_shell_gives_it):
    """The run's terminal hangs up (its ssh session dropped): the kernel sends SIGHUP and
    writes to the terminal fail from then on; the step reached is still saved, and the
    run ends with SIGHUP's status."""
    import pty
    import select

    out = tmp_path / "run"
    master, terminal = pty.openpty()
    # A session of its own whose controlling terminal is the pty (as a login shell's job).
    take = "import fcntl, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    proc = subprocess.Popen(
        [sys.executable, "-c", take + SLOW_STEPS, *TINY, "--output_dir", str(out)],
        env=_env(),
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
    )
    os.close(terminal)
    deadline = time.monotonic() + 120
    try:
        while not ((out / "log.jsonl").exists() and 3 in _losses(out)):
            assert proc.poll() is None and time.monotonic() < deadline, "no step 3"
            if select.select([master], [], [], 0.05)[0]:
                try:
                    os.read(master, 65536)  # the terminal shows what the run writes
                except OSError:
                    break
    finally:
        os.close(master)  # hang up
    assert proc.wait(timeout=120) == 129
    steps = outputs.saved_steps(out)
    assert len(steps) == 1 and 3 <= steps[0] < STEPS and max(_losses(out)) == steps[0]


def test_a_signal_is_timed_when_it_arrives_not_when_python_handles_it():
    """Python runs a signal's handler only between bytecodes: where the main thread sits
    in C (here a key derivation of about 2 s; in a run, a save waiting for the one
    before it) the handler runs when that returns. The stop's timing starts when the
    signal arrived."""
    import hashlib

    preemption = loop._Preemption(parse_args(TINY))
    handled = []
    note = preemption._note
    preemption._note = lambda signum, frame: (handled.append(time.monotonic()), note(signum, frame))
    began = time.monotonic()
    hashlib.pbkdf2_hmac("sha256", b"k", b"salt", 20_000)
    rounds = int(20_000 * 2.0 / max(time.monotonic() - began, 1e-4))  # one C call of ~2 s
    sent = []

    def send():
        time.sleep(0.2)
        sent.append(time.monotonic())
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    with preemption.watching():
        sender = threading.Thread(target=send)
        sender.start()
        hashlib.pbkdf2_hmac("sha256", b"k", b"salt", rounds)  # in C: the handler waits
        sender.join()
    assert preemption.noted and handled
    assert handled[0] - sent[0] > 0.3, "the handler ran at once: no C call held it back"
    assert preemption.at is not None and 0 <= preemption.at - sent[0] < 0.25
    assert preemption.at < handled[0]


def test_a_sigterm_during_a_save_call_stops_at_that_save(tmp_path, monkeypatch, capsys):
    """SIGTERM while a periodic save is being issued (step 2's save waiting for the one
    before it, say): that save is the stop's; no step after it is trained."""
    real = loop.Checkpoints.save

    def save(self, step, state, meta, **kwargs):
        issued = real(self, step, state, meta, **kwargs)
        if step == 2:
            signal.raise_signal(signal.SIGTERM)
        return issued

    monkeypatch.setattr(loop.Checkpoints, "save", save)
    out = tmp_path / "run"
    with pytest.raises(Preempted) as stopped:
        loop.run(parse_args([*TINY, "--save_steps", "2", "--output_dir", str(out)]))
    assert (stopped.value.step, stopped.value.saved) == (2, True)
    assert outputs.saved_steps(out) == [2] and max(_losses(out)) == 2
    assert re.search(
        r"^SIGTERM at step 2: saved \d+\.\d s after the signal", capsys.readouterr().out, re.M
    )


@pytest.mark.parametrize("when", ["step 2's save still written", "step 4's save waiting"])
def test_a_sigterm_while_a_save_is_written_keeps_that_save(tmp_path, monkeypatch, capsys, when):
    """SIGTERM while step 2's save is still being written (at step 3), or while step 4's
    save waits for it to be whole: the run waits for step 2's and stops there instead of
    writing a later step after it (one checkpoint written inside the grace period, not
    two), saying so; the resume trains the steps after it again and reaches an
    uninterrupted run's losses."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    every = ["--save_steps", "2"]
    loop.run(parse_args([*TINY, *every, "--output_dir", str(whole)]))
    if when == "step 2's save still written":
        signalled = 3
        monkeypatch.setattr(loop, "_finish", _sigterm_after(loop._finish, 3))
        monkeypatch.setattr(loop.Checkpoints, "saving", lambda self: True)
    else:
        signalled, real, calls = 4, loop.Checkpoints.wait, []

        def wait(self):
            calls.append(1)
            if len(calls) == 2:  # inside step 4's save, before it is issued
                signal.raise_signal(signal.SIGTERM)
                time.sleep(0.3)  # step 2's save, a while still written
            real(self)

        monkeypatch.setattr(loop.Checkpoints, "wait", wait)
    with pytest.raises(Preempted) as stopped:
        loop.run(parse_args([*TINY, *every, "--output_dir", str(out)]))
    assert (stopped.value.step, stopped.value.saved) == (2, True)
    assert outputs.saved_steps(out) == [2]
    said = capsys.readouterr().out
    assert re.search(
        rf"^SIGTERM at step {signalled}: saved \d+\.\d s after the signal \(the step's end "
        r"\d+\.\d s, step 2's save \d+\.\d s\); closing took \d+\.\d s more; step 2's save, "
        r"still being written when the signal came, is the one kept",
        said,
        re.M,
    ), said
    if when == "step 4's save waiting":  # the step had ended: the wait is the save's
        waited = re.search(r"\(the step's end 0\.0 s, step 2's save (\d+\.\d) s\)", said)
        assert waited and float(waited[1]) >= 0.3, said
    monkeypatch.undo()
    resume = ["--resume_from_checkpoint", "latest"]
    loop.run(parse_args([*TINY, *every, "--output_dir", str(out), *resume]))
    resumed, uninterrupted = _losses(out), _losses(whole)
    if not ON_GPU:
        assert resumed == uninterrupted
    else:
        # In this process the GPU runs atomic adds (the kernels', XLA's scatters), so two
        # runs of one job differ in their low bits: up to 8e-5 of a loss on an H200.
        assert resumed.keys() == uninterrupted.keys()
        assert resumed == pytest.approx(uninterrupted, rel=1e-3)
