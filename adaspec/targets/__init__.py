"""Target adapters over mlx-lm models (verify, taps, rollback) and model loaders."""
