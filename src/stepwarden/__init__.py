"""stepwarden."""
