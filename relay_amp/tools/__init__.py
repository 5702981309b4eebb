"""User tools on top of the pipeline: the command line, benchmarks and their PyTorch twins, built-in models,
the shipped digits model, metrics and the accuracy-aware search."""
