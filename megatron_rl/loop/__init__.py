"""The RL loop on the driver: the trainer, the hooks schedulers and plug-ins implement, request
bookkeeping, the baseline scheduler, evaluation, off-policy rules and the per-step records."""
