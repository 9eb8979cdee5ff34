"""The driver's checkpoint store: atomic step directories with a verified manifest (the trainer ranks
write their shards inside them: training/dist_checkpoint.py)."""
