"""Fast paths with plain twins: BLAS loading on Linux, entropy, recurrent replay."""
