"""The durable queue: the SQLite store of jobs and events, statuses, retention and the data directory."""
