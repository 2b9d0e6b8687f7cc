"""The simulators: deterministic models that drive Pacer's real decision code on simulated time.

* :mod:`.stragglers`: one PS training job with injected stragglers under a
  straggler policy (the controller's core and policies, the monitor, shard
  and executor cores);
* :mod:`.autoscale`: jobs under a resource scaler (the brain's core);
* :mod:`.cli`: ``pacer sim <scenario.yaml>``, for either kind of scenario;
* :mod:`.fields`: the scenario-file reader both share.

Simulators import only cores, policies and pure libraries, never a
service's IO modules.  Nothing is imported here, so each simulator loads
only what it needs.
"""
