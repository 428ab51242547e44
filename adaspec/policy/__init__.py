"""Decisions: gates, the floor and its probes, the plain-step clock, arm choice, draft length
and tree size, over the estimates each arm's steps teach (the adaptive policy composes them)."""
