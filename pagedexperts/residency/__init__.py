"""Residency: which routed experts occupy the K slots, and the wave plan (standard library only)."""
