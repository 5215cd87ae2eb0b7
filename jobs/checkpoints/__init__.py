"""Ferry's checkpoints: atomic directories with a manifest, trainable weights, training state, exports.

Importing this package must not import torch: the service's API process reads manifests through it."""
