"""Ray bootstrap, placement, and the Ray actors of a job (engines and trainer ranks)."""
