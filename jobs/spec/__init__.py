"""The job spec: YAML text in, a validated `JobSpec` out, with every problem located (`loading.py`)."""
