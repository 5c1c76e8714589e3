"""What is particular to each model family, one module per family (docs/adding-a-family.md)."""
