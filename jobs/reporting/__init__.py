"""What a running job measures and where its events go besides the report callback (trackers)."""
