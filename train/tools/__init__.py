"""The trainer's tools, each a `python -m train.tools.<name>` command beside the job:

- `profile`: forward/backward/recompute/communication time, bandwidth and memory per
  model and context, from `jax.profiler` traces (with `trace`, `hlo`, `roofline`,
  `report`);
- `trace`: one `jax.profiler` trace's time per phase, kernel class and communication
  (the trainer's `--profile_steps` traces, or a profile row's);
- `capacity`: the longest context a training step fits in, compiled, nothing run;
- `gradcheck`: one step's gradients under several layouts, per parameter;
- `export`: any saved checkpoint of a run as an HF directory (the run's own `hf/` is
  its last step's).

The job (`python -m train`) imports none of them. `hlo`, `roofline`, `report` and
`files` are modules these commands share, not commands: run as one, each says so.
"""

COMMANDS = ("profile", "trace", "capacity", "gradcheck", "export")


def not_a_command(module: str) -> str:
    """The one line a shared module run as a command (`python -m train.tools.hlo`) exits
    with."""
    commands = ", ".join(f"train.tools.{c}" for c in COMMANDS)
    return f"error: {module} is a module the tools share, not a command; the commands: {commands}"
