"""Acceptance, gates, the controller loop and stats."""
