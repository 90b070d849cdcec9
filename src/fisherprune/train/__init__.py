"""Training: data loading, built-in models and the pruning trainer."""
