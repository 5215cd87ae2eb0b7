"""Training objectives beyond next-token loss (DPO, ORPO): what the loop trains with and ``evaluate/`` measures."""
