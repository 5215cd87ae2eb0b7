"""The YAML shape guard lives in ``jobs`` (every entry point uses it, and ``jobs`` never imports ``service``);
re-exported here for the service's modules."""

from jobs.spec.yaml_guard import MAX_DEPTH, MAX_NODES, ShapeGuard, YamlShapeError, check_yaml_shape, shape_error

__all__ = ["MAX_DEPTH", "MAX_NODES", "ShapeGuard", "YamlShapeError", "check_yaml_shape", "shape_error"]
