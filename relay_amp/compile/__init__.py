"""The compile pipeline: build a converted module for a target (with tuning records when given) and tune it."""
