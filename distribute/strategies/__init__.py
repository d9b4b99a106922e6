"""Strategy implementations, one per module."""
