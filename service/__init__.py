"""The training service: REST API, durable queue, workers, dashboard."""
