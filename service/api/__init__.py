"""The HTTP face of the service: the FastAPI app, its routes, access control, error shapes and API schemas."""
