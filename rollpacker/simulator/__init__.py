"""Discrete-event what-if simulator of a synchronous RL cluster: the baseline (veRL-style:
P0 x R0, wait for all) versus RollPacker (tail batching, rollout TP planner, asynchronous reward,
stream trainer), from a recipe and a response-length model. See ``rollpacker-simulate``.

Modules: ``engine_model`` (decode/prefill cost, KV capacity, TP scaling, calibration from
measured constants), ``engine_sim`` (continuous batching with preemption, event-driven),
``lengths`` (parametric long tail or replayed lengths), ``costs`` (training and reward time),
``policies`` (one training step of each policy), ``runner`` (many steps, sweeps, reports),
``calibrate`` (fit to a measured benchmark run pair, see ``rollpacker-calibrate-simulator``) and
``paper_check`` (the paper's setup and figures, see ``rollpacker-simulate --paper-check``).
"""
