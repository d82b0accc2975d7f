"""The GPT baseline and what it needs to train, evaluate and sample: data, model, optimizer, runs."""
