"""Pure cores of the brain-optimizer: decisions only, no IO, no clock, no asyncio.

* :mod:`.autoscaler`: one job's resources over its life (DLRover 2023 §4.2
  stages steered by DLRover-RM's model), fed statistics windows.
* :mod:`.round`: one cluster round across jobs (DLRover-RM §4.3): rules,
  admission, the Eq. 11-14 greedy; the service and the simulator call it.
* :mod:`.stages`: DLRover 2023 §4.2, the three stages of a job's resources,
  sample (profile a new job), optimize (Eq. 10-11) and adjust (hot PS, idle
  PS); every plan clamped to the job's ``resources`` and ``limits``
  (:mod:`pacer.jobs.limits`).
* :mod:`.calibration`, :mod:`.fitting`, :mod:`.pareto`, :mod:`.cluster`:
  DLRover-RM's model (Eq. 1-6), its online fit, the Pareto candidates and
  the weighted greedy selection (Eq. 7-14).
* :mod:`.capacity`: what the autoscaled jobs share (Eq. 13's S).
* :mod:`.warmstart`: DLRover-RM Alg. 1, a start-up plan smoothed over the
  top-k most similar finished jobs.
* :mod:`.history`: the config DB's data model (a finished job's features,
  plans and observed profiles) and the top-k similarity query.
* :mod:`.running`: what the executor runs for a job, folded from its
  ``applied`` and node events (the plan in force, the plan as run).
* :mod:`.oom`: DLRover-RM §5.3, predict a node's memory growth and raise
  its memory before it runs out.
* :mod:`.placement`: Dike, nodes onto machines.

Every function is synchronous and deterministic; the service feeds in
observations (and time, where it matters) and applies the plans it gets back.
"""
