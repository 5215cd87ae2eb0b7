"""Other tools' configs turned into Ferry specs, with every key that cannot be honoured listed."""
