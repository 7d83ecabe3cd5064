"""Where a run reports: one run id across requeues, and its trackers (docs/tracking.md).

* :mod:`hpc.track.runid` — :func:`hpc.run_id`: one id per training run, created at the
  first start in the run directory, the same on every rank and after every requeue,
  in-job restart or resume;
* :mod:`hpc.track.sinks` — TensorBoard, W&B and MLflow, each opened on that id and
  saying which steps it already holds;
* :mod:`hpc.track.tracker` — the global master's trackers for a stage run: metric rows
  to points, one point per step after a resume.

Importing :mod:`hpc.track` imports neither torch nor any tracker package.
"""
