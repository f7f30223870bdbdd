"""SBP rules for ATen ops, one module per op family."""
