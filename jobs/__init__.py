"""Job specs, models, data and the training runner."""
