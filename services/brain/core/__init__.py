"""Pure cores of the brain-optimizer: decisions only, no IO, no clock, no asyncio.

* :mod:`.stages`: DLRover 2023 §4.2, the three stages of a job's resources,
  sample (profile a new job), optimize (Eq. 10-11) and adjust (hot PS, idle
  PS); also how a brain plan respects a job's ``resources`` and ``limits``.
* :mod:`.warmstart`: DLRover-RM Alg. 1, a start-up plan smoothed over the
  top-k most similar finished jobs.
* :mod:`.oom`: DLRover-RM §5.3, predict a PS's memory growth and raise its
  memory before it runs out.
* :mod:`.history`: the config DB's data model (a finished job's features,
  plans and observed profiles) and the top-k similarity query.

Every function is synchronous and deterministic; the service feeds in
observations (and time, where it matters) and applies the plans it gets back.
"""
