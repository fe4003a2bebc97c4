"""Adapters that run methods' original implementations live (each imported on use)."""
