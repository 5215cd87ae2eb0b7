"""Will a job fit: its device and host memory estimated from the spec, without loading a weight."""
