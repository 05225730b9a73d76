"""Helpers for testing applications and stepwarden itself (a throwaway PostgreSQL server)."""
