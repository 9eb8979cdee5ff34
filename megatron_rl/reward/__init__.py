"""Rewards, in three layers (each imports only the ones below it; ``.importlinter`` checks it):

* ``pool/``: the driver-side reward pool the trainer and the schedulers use
  (:class:`~megatron_rl.reward.pool.reward_pool.RewardPool`): reward workers as Ray actors or
  in-process, dispatch, retries, cancellation, autoscaling, adaptive code timeouts, metrics, and
  the LLM judge's path on the driver;
* ``graders/``: the rules that score one response (math-verify, the code reward, the LLM judge),
  each returning a :class:`~megatron_rl.reward.graders.result.RewardResult`;
* ``sandbox/``: where untrusted code runs (the contained two-process sandbox of the code reward)
  and the killable grading process of the math reward.
"""
