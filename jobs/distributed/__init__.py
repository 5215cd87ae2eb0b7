"""Data parallelism: one job on several ranks (``distributed.world_size``), each with the whole model.

``launch.py`` starts the ranks with torch's elastic launcher and relays rank 0's events to the job's
``report``; ``group.py`` is a rank's view of the process group (who leads, the collectives the runner
needs); ``batches.py`` gives each rank its rows of every global batch; ``gradients.py`` averages the
trainable gradients across ranks during backward, in buckets, as DDP does.
"""
