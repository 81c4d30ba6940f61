"""The trainer's tools, each a `python -m train.tools.<name>` command beside the job:

- `profile`: forward/backward/recompute/communication time, bandwidth and memory per
  model and context, from `jax.profiler` traces (with `trace`, `hlo`, `roofline`,
  `report`);
- `capacity`: the longest context a training step fits in, compiled, nothing run;
- `gradcheck`: one step's gradients under several layouts, per parameter.

The job (`python -m train`) imports none of them.
"""
