"""The training loop: a session set up from the spec, its steps, evaluation and samples between them."""
