"""metrale."""
